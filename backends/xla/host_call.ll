; The fixed part of every host call's XLA FFI handler: reading XLA's call frame. host_call.py
; appends the handler itself (its operand copies, the work call, its result copies, with their
; addresses baked in), which calls these; they are internal and inline into it.
;
; Byte offsets of XLA's C API (xla/ffi/api/c_api.h, 64-bit; the structs only grow at their end):
;   XLA_FFI_CallFrame  {size 0, extension_start 8, api 16, ctx 24, stage 32, args 40, rets 80, ...}
;   XLA_FFI_Args/Rets  {size 0, extension_start 8, size n 16, types 24, ptrs 32}
;   XLA_FFI_Buffer     {size 0, extension_start 8, dtype 16, data 24, ...}
;   XLA_FFI_Api        {..., version.major 32, version.minor 36, ..., XLA_FFI_Stream_Get 80}
;   XLA_FFI_Extension_Base {size 0, type 8, next 16}; the metadata extension's metadata at 24
;   XLA_FFI_Metadata   {size 0, extension_start 8, api_version.major 24, .minor 28, traits 32}
;   XLA_FFI_ExecutionStage: instantiate 0, prepare 1, initialize 2, execute 3
;   XLA_FFI_Extension_Type: metadata 1

; Whether the frame asks to execute. XLA's metadata query (a frame with the metadata extension)
; gets the API version the runtime reports and no traits: a host call syncs its stream, so it
; may not be captured into a CUDA graph. Other stages run nothing.
define internal i1 @hc_execute(ptr %frame) alwaysinline {
entry:
  %extp = getelementptr i8, ptr %frame, i64 8
  %ext = load ptr, ptr %extp
  %hasext = icmp ne ptr %ext, null
  br i1 %hasext, label %meta, label %stage
meta:
  %typ = getelementptr i8, ptr %ext, i64 8
  %ty = load i32, ptr %typ
  %ismeta = icmp eq i32 %ty, 1
  br i1 %ismeta, label %fill, label %no
fill:
  %mdp = getelementptr i8, ptr %ext, i64 24
  %md = load ptr, ptr %mdp
  %apip = getelementptr i8, ptr %frame, i64 16
  %api = load ptr, ptr %apip
  %majp = getelementptr i8, ptr %api, i64 32
  %minp = getelementptr i8, ptr %api, i64 36
  %maj = load i32, ptr %majp
  %min = load i32, ptr %minp
  %mmajp = getelementptr i8, ptr %md, i64 24
  %mminp = getelementptr i8, ptr %md, i64 28
  %mtrp = getelementptr i8, ptr %md, i64 32
  store i32 %maj, ptr %mmajp
  store i32 %min, ptr %mminp
  store i32 0, ptr %mtrp
  br label %no
stage:
  %stp = getelementptr i8, ptr %frame, i64 32
  %st = load i32, ptr %stp
  %exec = icmp eq i32 %st, 3
  ret i1 %exec
no:
  ret i1 false
}

; The program's CUDA stream (XLA_FFI_Stream_Get), or null where `gpu` is false (JAX's CPU
; platform has no stream).
define internal ptr @hc_stream(ptr %frame, i1 %gpu) alwaysinline {
entry:
  %args = alloca [4 x i64], align 8      ; XLA_FFI_Stream_Get_Args {size, extension_start, ctx, stream}
  br i1 %gpu, label %get, label %none
get:
  %apip = getelementptr i8, ptr %frame, i64 16
  %api = load ptr, ptr %apip
  %ctxp = getelementptr i8, ptr %frame, i64 24
  %ctx = load ptr, ptr %ctxp
  store i64 32, ptr %args
  %a1 = getelementptr i64, ptr %args, i64 1
  store i64 0, ptr %a1
  %a2 = getelementptr i64, ptr %args, i64 2
  store ptr %ctx, ptr %a2
  %a3 = getelementptr i64, ptr %args, i64 3
  store i64 0, ptr %a3
  %getp = getelementptr i8, ptr %api, i64 80
  %get.fn = load ptr, ptr %getp
  %err = call ptr %get.fn(ptr %args)
  %stream = load ptr, ptr %a3
  ret ptr %stream
none:
  ret ptr null
}

; The frame's array of operand buffers (`rets` false) or result buffers (true).
define internal ptr @hc_buffers(ptr %frame, i1 %rets) alwaysinline {
entry:
  %off = select i1 %rets, i64 112, i64 72
  %p = getelementptr i8, ptr %frame, i64 %off
  %bufs = load ptr, ptr %p
  ret ptr %bufs
}

; The data pointer of buffer i of such an array.
define internal ptr @hc_data(ptr %bufs, i64 %i) alwaysinline {
entry:
  %bp = getelementptr ptr, ptr %bufs, i64 %i
  %b = load ptr, ptr %bp
  %dp = getelementptr i8, ptr %b, i64 24
  %d = load ptr, ptr %dp
  ret ptr %d
}

; Stand-ins for cudaMemcpyAsync and cudaStreamSynchronize on JAX's CPU platform.
define internal i32 @host_memcpy(ptr %dst, ptr %src, i64 %n, i32 %kind, ptr %stream) alwaysinline {
  call void @llvm.memcpy.p0.p0.i64(ptr %dst, ptr %src, i64 %n, i1 false)
  ret i32 0
}

define internal i32 @host_sync(ptr %stream) alwaysinline {
  ret i32 0
}

declare void @llvm.memcpy.p0.p0.i64(ptr, ptr, i64, i1)
