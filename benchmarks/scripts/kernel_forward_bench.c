/* Time nf_forward called directly (no Python, no ctypes): one thread, best of 7, per shape.
 *
 *   gcc -O3 -mavx2 -mfma -mf16c -fopenmp benchmarks/scripts/kernel_forward_bench.c \
 *       src/normfold/ops/csrc/rmsnorm_cpu.c -Isrc/normfold/ops/csrc -o /tmp/kfb -lm
 *   /tmp/kfb 1      # bfloat16 forward (0 = float32, 2 = float16)
 *   /tmp/kfb 1 1    # the same with the fused residual add
 *
 * (-march=native instead of the AVX2 flags builds the AVX-512 path on a CPU that has it.) Used for
 * the before/after table of docs/kernels-cpu.md "bfloat16 on the AVX2 path".
 */
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <time.h>
#include <string.h>
int nf_forward(int dtype, const void *x, int64_t xs, const void *res, int64_t rst, const void *w, int wdt,
               const void *b, int bdt, void *y, void *s, float *rstd, int64_t rows, int64_t n, float eps,
               int compressed, int nthreads);
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
int main(int argc,char**argv){
  int64_t shapes[][2]={{512,768},{4096,768},{1024,4096},{8192,1024},{4096,1023}};
  int dt = argc>1?atoi(argv[1]):1; int res = argc>2?atoi(argv[2]):0;
  for(int s=0;s<5;s++){
    int64_t R=shapes[s][0],N=shapes[s][1];
    int64_t es = dt==0?4:2;
    uint16_t *x=aligned_alloc(64,R*N*4+64),*y=aligned_alloc(64,R*N*4+64),*r=aligned_alloc(64,R*N*4+64),*sb=aligned_alloc(64,R*N*4+64);
    float *w=malloc(N*4),*b=malloc(N*4);
    for(int64_t i=0;i<R*N*es/2;i++){x[i]=0x3f80+(i%97);r[i]=0x3f00+(i%89);} 
    if(dt==0) for(int64_t i=0;i<R*N;i++){((float*)x)[i]=(i%97)*0.01f;((float*)r)[i]=(i%89)*0.01f;}
    for(int i=0;i<N;i++){w[i]=1+i*1e-3f;b[i]=i*1e-3f;}
    double best=1e9; int reps = 20000000/(R*N)+3;
    for(int k=0;k<7;k++){double t0=now();for(int q=0;q<reps;q++)nf_forward(dt,x,N,res?r:0,N,w,0,b,0,y,res?sb:0,0,R,N,1e-5f,0,1);double t=(now()-t0)/reps;if(t<best)best=t;}
    printf("%ldx%ld %.1f us\n",R,N,best*1e6);
  }
}
