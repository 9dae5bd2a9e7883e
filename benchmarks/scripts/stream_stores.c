// Non-temporal stores for a write-dominated kernel: an int8 decode to 32 MiB of f32, stored
// normally and through an L1 tile streamed out with SSE2 _mm_stream_ps (xla_ext/cpu_stream.h;
// figures in docs/design.md, "Large outputs skip the cache"). 4 repetitions, ms each way.
//   gcc -O3 -march=x86-64-v3 -o /tmp/stream_stores benchmarks/scripts/stream_stores.c && /tmp/stream_stores
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
static double now(){struct timespec t; clock_gettime(CLOCK_MONOTONIC,&t); return t.tv_sec+t.tv_nsec*1e-9;}
__attribute__((noinline)) void deq_reg(const int8_t* q, float s, float* o, long n){ for(long i=0;i<n;i++) o[i]=q[i]*s; }
__attribute__((noinline)) void stream(float* d, const float* s, long n){ for(long i=0;i<n;i+=4) _mm_stream_ps(d+i,_mm_loadu_ps(s+i)); }
void deq_tile(const int8_t* q, float s, float* o, long n){
  float tile[2048] __attribute__((aligned(64)));
  for(long i=0;i<n;i+=2048){ deq_reg(q+i,s,tile,2048); stream(o+i,tile,2048);} _mm_sfence(); }
int main(){ long n=8l<<20; int8_t* q=aligned_alloc(64,n); float* o=aligned_alloc(64,n*4);
  for(long i=0;i<n;i++) q[i]=i*7; memset(o,0,n*4);
  for(int r=0;r<4;r++){ double t=now(); deq_reg(q,0.5f,o,n); double a=now()-t; t=now(); deq_tile(q,0.5f,o,n); double b=now()-t;
  printf("regular %.2f ms  tile+stream(sse) %.2f ms\n", a*1e3, b*1e3);} return (int)o[5]; }
