/* A/B of nf_backward from two builds of the kernel library, called directly (no Python), in
 * interleaved rounds; medians of the per-call time, and whether dx and dweight agree bit for bit.
 *
 *   S=src/normfold/ops/csrc
 *   gcc -O3 -shared -fPIC -march=native -fopenmp $S/rmsnorm_cpu.c -I$S -o /tmp/A.so -lm
 *   gcc -O3 -shared -fPIC -march=native -fopenmp -DSOME_VARIANT $S/rmsnorm_cpu.c -I$S -o /tmp/B.so -lm
 *   gcc -O2 benchmarks/scripts/kernel_backward_ab.c -o /tmp/bwd_ab -ldl
 *   /tmp/bwd_ab /tmp/A.so /tmp/B.so [threads=1] [dtype: 0 f32, 1 bf16, 2 f16] [rounds=40] [no dweight=0]
 *
 * (-mavx2 -mfma -mf16c instead of -march=native builds the AVX2 path.) Any library exporting
 * nf_backward with the same signature can stand in for B, e.g. a plain streaming loop as a floor
 * (docs/kernels-cpu.md, "Issue 12 targets on the Zen 5 EPYC"); "DIFFERENT" is expected then.
 */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
typedef int (*bw_t)(int, const void *, const void *, const void *, int64_t, const void *, int, const float *, void *,
                    float *, float *, int64_t, int64_t, int, int);
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
static int cmp(const void*a,const void*b){double x=*(double*)a,y=*(double*)b;return x<y?-1:x>y;}
int main(int argc,char**argv){
  if(argc<3){printf("usage: %s A.so B.so [threads] [dtype] [rounds] [nodw]\n",argv[0]);return 2;}
  bw_t f[2];
  for(int k=0;k<2;k++){void*h=dlopen(argv[1+k],RTLD_NOW|RTLD_LOCAL); if(!h){printf("%s\n",dlerror());return 1;} f[k]=(bw_t)dlsym(h,"nf_backward");}
  int nth = argc>3?atoi(argv[3]):1; int dt = argc>4?atoi(argv[4]):0; int rounds = argc>5?atoi(argv[5]):40; int nodw = argc>6?atoi(argv[6]):0;
  if(rounds<1||rounds>200){printf("rounds: 1 to 200\n");return 2;}
  int64_t shapes[][2]={{512,768},{4096,768},{8192,1024},{4096,1023},{2048,768},{16384,768}};
  for(int s=0;s<6;s++){
    int64_t R=shapes[s][0],N=shapes[s][1], es = dt==0?4:2;
    float *dy=aligned_alloc(64,R*N*4+64),*x=aligned_alloc(64,R*N*4+64),*dx=aligned_alloc(64,R*N*4+64),*dx2=aligned_alloc(64,R*N*4+64);
    float *w=malloc(N*4),*rstd=malloc(R*4),*dw=malloc(N*4*nth),*dw2=malloc(N*4*nth);
    for(int64_t i=0;i<R*N;i++){x[i]=((i*7919)%1000)*1e-3f-0.5f;dy[i]=((i*104729)%1000)*1e-3f-0.5f;}
    if(dt) for(int64_t i=0;i<R*N;i++){((uint16_t*)x)[i]=0x3f00+(i%113);((uint16_t*)dy)[i]=0x3e00+(i%101);}
    for(int i=0;i<N;i++)w[i]=1+i*1e-3f;
    for(int64_t i=0;i<R;i++)rstd[i]=1.3f;
    int reps = 30000000/(R*N)+1; double t[2][200];
    for(int r=0;r<rounds;r++) for(int k=0;k<2;k++){
      double t0=now(); for(int q=0;q<reps;q++) f[k](dt,dy,0,x,N,w,0,rstd,k?dx2:dx,nodw?0:(k?dw2:dw),0,R,N,0,nth); t[k][r]=(now()-t0)/reps;}
    int same = memcmp(dx,dx2,R*N*es)==0 && (nodw || memcmp(dw,dw2,N*4)==0);
    qsort(t[0],rounds,8,cmp);qsort(t[1],rounds,8,cmp);
    printf("%6ldx%-5ld A %8.1f us  B %8.1f us  B/A %.3f  %s\n",R,N,t[0][rounds/2]*1e6,t[1][rounds/2]*1e6,t[1][rounds/2]/t[0][rounds/2], same?"same bits":"DIFFERENT");
    free(dy);free(x);free(dx);free(dx2);free(w);free(rstd);free(dw);free(dw2);
  }
}
