/* A/B of nf_forward (y = norm(x)·w, weight in the input dtype, as `bench ops` and a converted model
 * call it) from two builds of the kernel library, called directly (no Python), in interleaved
 * rounds; medians of the per-call time, a plain copy (memcpy) of x as the floor, A's statistics pass
 * alone (nf_forward with y = 0: the row scales only), and whether the two builds' y agree bit for bit.
 *
 *   S=src/normfold/ops/csrc
 *   gcc -O3 -shared -fPIC -march=native -fopenmp $S/rmsnorm_cpu.c -I$S -o /tmp/A.so -lm
 *   gcc -O3 -shared -fPIC -march=native -fopenmp -DSOME_VARIANT $S/rmsnorm_cpu.c -I$S -o /tmp/B.so -lm
 *   gcc -O2 benchmarks/scripts/kernel_forward_ab.c -o /tmp/fwd_ab -ldl
 *   /tmp/fwd_ab /tmp/A.so /tmp/B.so [threads=1] [dtype: 0 f32, 1 bf16, 2 f16] [rounds=40] [fused=0]
 *
 * fused=1 times the fused residual add instead (s = x + r, y = norm(s)); the copy then copies x and
 * r (two reads, two writes, as many bytes as the fused op moves) and s is compared too.
 *
 * (-mavx2 -mfma -mf16c instead of -march=native builds the AVX2 path.) A change to the order of a
 * row's sum of squares makes "DIFFERENT" expected (last-bit differences in some rows).
 */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
typedef int (*fw_t)(int, const void *, int64_t, const void *, int64_t, const void *, int, const void *, int, void *,
                    void *, float *, int64_t, int64_t, float, int, int);
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
static int cmp(const void*a,const void*b){double x=*(double*)a,y=*(double*)b;return x<y?-1:x>y;}
static double med(double*v,int n){qsort(v,n,sizeof(double),cmp);return v[n/2];}
int main(int argc,char**argv){
  if(argc<3){printf("usage: %s A.so B.so [threads] [dtype] [rounds] [fused]\n",argv[0]);return 2;}
  fw_t f[2];
  for(int k=0;k<2;k++){void*h=dlopen(argv[1+k],RTLD_NOW|RTLD_LOCAL); if(!h){printf("%s\n",dlerror());return 1;} f[k]=(fw_t)dlsym(h,"nf_forward");}
  int nth = argc>3?atoi(argv[3]):1; int dt = argc>4?atoi(argv[4]):0; int rounds = argc>5?atoi(argv[5]):40; int fused = argc>6?atoi(argv[6]):0;
  if(rounds<1||rounds>200){printf("rounds: 1 to 200\n");return 2;}
  int64_t shapes[][2]={{512,768},{4096,768},{1024,4096},{8192,1024},{4096,1023}};
  printf("%sthreads %d dtype %d rounds %d: median us A, B, copy, A stats only; B/A\n",fused?"fused add, ":"",nth,dt,rounds);
  for(int s=0;s<5;s++){
    int64_t R=shapes[s][0],N=shapes[s][1],es=dt==0?4:2,bytes=R*N*es;
    unsigned char*x=aligned_alloc(64,bytes+64),*y[2]={aligned_alloc(64,bytes+64),aligned_alloc(64,bytes+64)},*c=aligned_alloc(64,bytes+64),*w=malloc(N*es);
    unsigned char*rb=aligned_alloc(64,bytes+64),*c2=aligned_alloc(64,bytes+64),*sb[2]={aligned_alloc(64,bytes+64),aligned_alloc(64,bytes+64)};
    const void*res=fused?rb:0;
    float*rstd=malloc(R*sizeof(float));
    for(int64_t i=0;i<R*N;i++){ if(dt==0) ((float*)x)[i]=((i*7919)%2001-1000)*0.003f;
      else ((uint16_t*)x)[i]=(uint16_t)((dt==1?0x3e00:0x3000)+(i*7919)%1500) | (uint16_t)((i%3==0)<<15);}
    for(int64_t i=0;i<bytes;i++) rb[i]=x[(i*31+7)%bytes];
    for(int64_t i=0;i<N;i++){ if(dt==0) ((float*)w)[i]=1+i*1e-3f; else ((uint16_t*)w)[i]=(uint16_t)((dt==1?0x3f80:0x3c00)+i%64);}
    int reps = (int)(40000000/bytes)+1; double t[4][200];
    for(int r=0;r<rounds;r++) for(int k=0;k<4;k++){
      int kk=(r&1)?3-k:k; double t0=now();
      for(int q=0;q<reps;q++){ if(kk==2){ memcpy(c,x,bytes); if(fused) memcpy(c2,rb,bytes);}
        else if(kk==3) f[0](dt,x,N,res,N,w,dt,0,0,0,sb[0],rstd,R,N,1e-5f,0,nth);
        else f[kk](dt,x,N,res,N,w,dt,0,0,y[kk],sb[kk],0,R,N,1e-5f,0,nth);}
      t[kk][r]=(now()-t0)/reps*1e6;}
    volatile unsigned char sink=c[bytes-1]^(fused?c2[bytes-1]:0); (void)sink; /* keeps the copies from being optimised away */
    int same=memcmp(y[0],y[1],bytes)==0 && (!fused || memcmp(sb[0],sb[1],bytes)==0); double a=med(t[0],rounds),b=med(t[1],rounds),cp=med(t[2],rounds),st=med(t[3],rounds);
    printf("%5ldx%-5ld A %7.1f  B %7.1f  copy %7.1f  stats %7.1f  B/A %.3f  A/copy %.2f  B/copy %.2f  stats/copy %.2f  %s\n",
           R,N,a,b,cp,st,b/a,a/cp,b/cp,st/cp,same?"same":"DIFFERENT");
    free(x);free(y[0]);free(y[1]);free(c);free(w);free(rstd);free(rb);free(c2);free(sb[0]);free(sb[1]);
  }
}
