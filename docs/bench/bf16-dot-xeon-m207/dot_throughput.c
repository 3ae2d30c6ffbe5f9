// Instruction throughput of one core: 12 independent accumulators in registers, each instruction 2.4e9 times.
// gcc -O2 -march=native dot_throughput.c; the 24-chain column of log.md: every 12 made 24. One loop per instruction,
// as measured (a version with the loop in one macro ran 2-8x slower, beside other work; not looked into).
#include <immintrin.h>
#include <stdio.h>
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
int main(){
  __m512i a[12]; __m512i w=_mm512_set1_epi8(3), x=_mm512_set1_epi8(5);
  for(int i=0;i<12;i++) a[i]=_mm512_setzero_si512();
  long n=200000000; double t=now();
  for(long i=0;i<n;i++){
    #pragma GCC unroll 12
    for(int j=0;j<12;j++) a[j]=_mm512_dpbusd_epi32(a[j],w,x);
    __asm__ volatile("" : "+v"(w));
  }
  t=now()-t; __m512i s=a[0]; for(int i=1;i<12;i++) s=_mm512_add_epi32(s,a[i]);
  printf("vpdpbusd zmm: %.2f G/s (%d)\n", n*12/t/1e9, _mm512_reduce_add_epi32(s));
  __m512 f[12]; __m512bh wb=(__m512bh)_mm512_set1_epi16(0x3f80), xb=wb;
  for(int i=0;i<12;i++) f[i]=_mm512_setzero_ps();
  t=now();
  for(long i=0;i<n;i++){
    #pragma GCC unroll 12
    for(int j=0;j<12;j++) f[j]=_mm512_dpbf16_ps(f[j],wb,xb);
    __asm__ volatile("" : "+v"(wb));
  }
  t=now()-t; __m512 g=f[0]; for(int i=1;i<12;i++) g=_mm512_add_ps(g,f[i]);
  printf("vdpbf16ps zmm: %.2f G/s (%f)\n", n*12/t/1e9, _mm512_reduce_add_ps(g));
  __m512 h[12]; __m512 u=_mm512_set1_ps(1.0001f);
  for(int i=0;i<12;i++) h[i]=_mm512_setzero_ps();
  t=now();
  for(long i=0;i<n;i++){
    #pragma GCC unroll 12
    for(int j=0;j<12;j++) h[j]=_mm512_fmadd_ps(h[j],u,u);
    __asm__ volatile("" : "+v"(u));
  }
  t=now()-t; g=h[0]; for(int i=1;i<12;i++) g=_mm512_add_ps(g,h[i]);
  printf("vfmadd zmm: %.2f G/s (%f)\n", n*12/t/1e9, _mm512_reduce_add_ps(g));
}
