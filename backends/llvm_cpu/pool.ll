
; strata native thread pool
%timespec = type { i64, i64 }

@g_gen = internal global i32 0, align 64
@g_sleepers = internal global i32 0, align 64
@g_work = internal global i64 0, align 64
@g_done = internal global i32 0, align 64
@g_caller_waiting = internal global i32 0, align 64
@g_fn = internal global ptr null, align 64
@g_args = internal global ptr null, align 8
@g_total = internal global i64 0, align 8
@g_spin = internal global i64 262144, align 64
@g_yield = internal global i64 2097152, align 8
@g_caller_spin = internal global i64 1048576, align 8
@g_started = internal global i32 0, align 64
@g_caller_timeout = internal constant %timespec { i64 0, i64 2000000 }

declare void @llvm.x86.sse2.pause()
declare i64 @llvm.readcyclecounter()
declare i32 @sched_yield()
declare i64 @syscall(i64, ...)
declare i32 @pthread_create(ptr, ptr, ptr, ptr)
declare i32 @pthread_detach(i64)
declare i32 @sigfillset(ptr)
declare i32 @sigdelset(ptr, i32)
declare i32 @pthread_sigmask(i32, ptr, ptr)

define internal void @futex_wait(ptr %addr, i32 %val, ptr %timeout) noinline {
  %v = zext i32 %val to i64
  %r = call i64 (i64, ...) @syscall(i64 202, ptr %addr, i64 128, i64 %v, ptr %timeout)
  ret void
}

define internal void @futex_wake(ptr %addr, i32 %n) noinline {
  %n64 = zext i32 %n to i64
  %r = call i64 (i64, ...) @syscall(i64 202, ptr %addr, i64 129, i64 %n64)
  ret void
}

; Claim and run chunks of whatever job is current until a claim comes back invalid.
define internal void @run_chunks() {
entry:
  br label %loop
loop:
  %v = atomicrmw add ptr @g_work, i64 1 acq_rel, align 8
  %idx = and i64 %v, 4294967295
  %n = lshr i64 %v, 32
  %ok = icmp ult i64 %idx, %n
  br i1 %ok, label %work, label %exit
work:
  %fn = load ptr, ptr @g_fn, align 8
  %args = load ptr, ptr @g_args, align 8
  %total = load i64, ptr @g_total, align 8
  %base = udiv i64 %total, %n
  %rem = urem i64 %total, %n
  %lt = icmp ult i64 %idx, %rem
  %minir = select i1 %lt, i64 %idx, i64 %rem
  %b0 = mul i64 %idx, %base
  %begin = add i64 %b0, %minir
  %extra = zext i1 %lt to i64
  %len = add i64 %base, %extra
  %end = add i64 %begin, %len
  %nonempty = icmp ne i64 %len, 0
  br i1 %nonempty, label %call, label %fin
call:
  call void %fn(ptr %args, i64 %begin, i64 %end)
  br label %fin
fin:
  %old = atomicrmw add ptr @g_done, i32 1 seq_cst, align 4
  %new = add i32 %old, 1
  %n32 = trunc i64 %n to i32
  %last = icmp eq i32 %new, %n32
  br i1 %last, label %check_caller, label %loop
check_caller:
  %cw = load atomic i32, ptr @g_caller_waiting seq_cst, align 4
  %sleeping = icmp ne i32 %cw, 0
  br i1 %sleeping, label %wake_caller, label %loop
wake_caller:
  call void @futex_wake(ptr @g_done, i32 1)
  br label %loop
exit:
  ret void
}

; Wait until the i32 at %word differs from %seen: spin with `pause` for g_spin ticks, then
; sched_yield until g_spin + g_yield, then sleep on the futex, counted in the i32 at %sleepers
; (whoever changes %word wakes the futex when that count is non-zero). Returns the new value.
define internal i32 @wait_change(ptr %word, i32 %seen, ptr %sleepers) {
entry:
  %t0 = call i64 @llvm.readcyclecounter()
  %spin = load atomic i64, ptr @g_spin monotonic, align 8
  %yield = load atomic i64, ptr @g_yield monotonic, align 8
  %spin_yield = add i64 %spin, %yield
  br label %spinloop
spinloop:
  %c1 = load atomic i32, ptr %word acquire, align 4
  %chg1 = icmp ne i32 %c1, %seen
  br i1 %chg1, label %got, label %spinpause
spinpause:
  call void @llvm.x86.sse2.pause()
  %t1 = call i64 @llvm.readcyclecounter()
  %el1 = sub i64 %t1, %t0
  %more1 = icmp ult i64 %el1, %spin
  br i1 %more1, label %spinloop, label %yieldloop
yieldloop:
  %c2 = load atomic i32, ptr %word acquire, align 4
  %chg2 = icmp ne i32 %c2, %seen
  br i1 %chg2, label %got, label %yieldbody
yieldbody:
  %y = call i32 @sched_yield()
  %t2 = call i64 @llvm.readcyclecounter()
  %el2 = sub i64 %t2, %t0
  %more2 = icmp ult i64 %el2, %spin_yield
  br i1 %more2, label %yieldloop, label %sleep
sleep:
  %s0 = atomicrmw add ptr %sleepers, i32 1 seq_cst, align 4
  br label %sleeploop
sleeploop:
  %c3 = load atomic i32, ptr %word seq_cst, align 4
  %chg3 = icmp ne i32 %c3, %seen
  br i1 %chg3, label %woke, label %sleepbody
sleepbody:
  call void @futex_wait(ptr %word, i32 %seen, ptr null)
  br label %sleeploop
woke:
  %s1 = atomicrmw sub ptr %sleepers, i32 1 seq_cst, align 4
  br label %got
got:
  %g = phi i32 [ %c1, %spinloop ], [ %c2, %yieldloop ], [ %c3, %woke ]
  ret i32 %g
}

; Add 1 to the i32 at %word and wake up to %n of its futex sleepers, counted at %sleepers (the
; other side of wait_change: both seq_cst, so a sleeper either sees the new value or is counted).
define internal void @bump(ptr %word, ptr %sleepers, i32 %n) {
entry:
  %old = atomicrmw add ptr %word, i32 1 seq_cst, align 4
  %sl = load atomic i32, ptr %sleepers seq_cst, align 4
  %any = icmp ne i32 %sl, 0
  br i1 %any, label %wake, label %ret
wake:
  call void @futex_wake(ptr %word, i32 %n)
  br label %ret
ret:
  ret void
}

define internal ptr @worker_main(ptr %unused) {
entry:
  %g0 = load atomic i32, ptr @g_gen acquire, align 4
  br label %wait
wait:
  %seen = phi i32 [ %g0, %entry ], [ %g, %wait ]
  %g = call i32 @wait_change(ptr @g_gen, i32 %seen, ptr @g_sleepers)
  call void @run_chunks()
  br label %wait
}

define void @strata_parallel_for(ptr %fn, ptr %args, i64 %total, i64 %n) {
entry:
  %empty = icmp sle i64 %n, 0
  br i1 %empty, label %ret, label %publish
publish:
  store ptr %fn, ptr @g_fn, align 8
  store ptr %args, ptr @g_args, align 8
  store i64 %total, ptr @g_total, align 8
  store atomic i32 0, ptr @g_done monotonic, align 4
  %w = shl i64 %n, 32
  store atomic i64 %w, ptr @g_work release, align 8
  call void @bump(ptr @g_gen, ptr @g_sleepers, i32 2147483647)
  call void @run_chunks()
  %n32 = trunc i64 %n to i32
  %t0 = call i64 @llvm.readcyclecounter()
  %cspin = load atomic i64, ptr @g_caller_spin monotonic, align 8
  br label %spinloop
spinloop:
  %d1 = load atomic i32, ptr @g_done acquire, align 4
  %fin1 = icmp eq i32 %d1, %n32
  br i1 %fin1, label %ret, label %spinpause
spinpause:
  call void @llvm.x86.sse2.pause()
  %t1 = call i64 @llvm.readcyclecounter()
  %el = sub i64 %t1, %t0
  %more = icmp ult i64 %el, %cspin
  br i1 %more, label %spinloop, label %sleep
sleep:
  store atomic i32 1, ptr @g_caller_waiting seq_cst, align 4
  br label %sleeploop
sleeploop:
  %d2 = load atomic i32, ptr @g_done seq_cst, align 4
  %fin2 = icmp eq i32 %d2, %n32
  br i1 %fin2, label %woke, label %sleepbody
sleepbody:
  call void @futex_wait(ptr @g_done, i32 %d2, ptr @g_caller_timeout)
  br label %sleeploop
woke:
  store atomic i32 0, ptr @g_caller_waiting seq_cst, align 4
  br label %ret
ret:
  ret void
}

; A detached thread running fn, with asynchronous signals blocked in it (synchronous ones stay
; deliverable: a crash in a kernel must still be reported); 0 when it was created.
define internal i32 @spawn(ptr %fn) {
entry:
  %set = alloca [128 x i8], align 8
  %old = alloca [128 x i8], align 8
  %tid = alloca i64, align 8
  %f = call i32 @sigfillset(ptr %set)
  %d4 = call i32 @sigdelset(ptr %set, i32 4)
  %d5 = call i32 @sigdelset(ptr %set, i32 5)
  %d6 = call i32 @sigdelset(ptr %set, i32 6)
  %d7 = call i32 @sigdelset(ptr %set, i32 7)
  %d8 = call i32 @sigdelset(ptr %set, i32 8)
  %d11 = call i32 @sigdelset(ptr %set, i32 11)
  %m = call i32 @pthread_sigmask(i32 2, ptr %set, ptr %old)
  %r = call i32 @pthread_create(ptr %tid, ptr null, ptr %fn, ptr null)
  %ok = icmp eq i32 %r, 0
  br i1 %ok, label %detach, label %done
detach:
  %t = load i64, ptr %tid, align 8
  %dr = call i32 @pthread_detach(i64 %t)
  br label %done
done:
  %m2 = call i32 @pthread_sigmask(i32 2, ptr %old, ptr null)
  ret i32 %r
}

; Start n more workers; returns how many were started.
define i32 @strata_pool_start(i32 %n) {
entry:
  br label %loop
loop:
  %i = phi i32 [ 0, %entry ], [ %i1, %created ]
  %more = icmp slt i32 %i, %n
  br i1 %more, label %create, label %done
create:
  %r = call i32 @spawn(ptr @worker_main)
  %ok = icmp eq i32 %r, 0
  br i1 %ok, label %created, label %done
created:
  %s = atomicrmw add ptr @g_started, i32 1 seq_cst, align 4
  %i1 = add i32 %i, 1
  br label %loop
done:
  ret i32 %i
}

; Wake the workers without a job: they claim nothing (the last job's chunks are all taken) and
; start a fresh spin, so that a job published soon after finds them awake. For a caller that
; knows work is coming (a host call in a GPU program, waiting for its operands) and must not pay
; the futex wake-ups on the critical path. It writes no job state, so any thread may call it at any
; time: during a job it only brings the workers to that job's chunks sooner.
define void @strata_pool_wake() {
  call void @bump(ptr @g_gen, ptr @g_sleepers, i32 2147483647)
  ret void
}

define void @strata_pool_set_spin(i64 %spin, i64 %yield, i64 %caller_spin) {
  store atomic i64 %spin, ptr @g_spin monotonic, align 8
  store atomic i64 %yield, ptr @g_yield monotonic, align 8
  store atomic i64 %caller_spin, ptr @g_caller_spin monotonic, align 8
  ret void
}

; In a child after fork(): the parent's workers do not exist here, so forget them.
define void @strata_pool_after_fork() {
  store atomic i32 0, ptr @g_sleepers seq_cst, align 4
  store atomic i32 0, ptr @g_caller_waiting seq_cst, align 4
  store atomic i32 0, ptr @g_started seq_cst, align 4
  ret void
}

define i32 @strata_pool_sleepers() {
  %s = load atomic i32, ptr @g_sleepers seq_cst, align 4
  ret i32 %s
}

define i32 @strata_pool_started() {
  %s = load atomic i32, ptr @g_started seq_cst, align 4
  ret i32 %s
}

define i64 @strata_rdtsc() {
  %t = call i64 @llvm.readcyclecounter()
  ret i64 %t
}

; A segment program: n instructions of 10 i64 each, run in order on the calling thread, whose
; kernels go over the pool like parallel_for. It replaces the Python glue between a CPU
; partition's kernels (backends/llvm_cpu/executor.py `native`). Fields (i64 index):
;   0 kind  1 fn  2 args  3 total/begin/add/nbytes/rows  4 src  5 mult/lds  6 min_chunk/ldd
;   7 dst  8 end/idx/mask  9 ncols
; kind 0 PAR:    total = field3 + (src ? *src * mult : 0); chunks = min(maxc, total,
;                ceil(total / min_chunk)); one chunk runs on this thread, more over the pool
; kind 1 ONE:    fn(args, field3, field8) on this thread
; kind 2 SET:    *dst = *src * mult + field3
; kind 3 COPY:   memcpy(dst, src, field3)
; kind 4 GATHER: for r < field3, j < ncols: dst[r*ldd + j] = src[r*lds + idx[j]] (32-bit values)
; kind 5 TSC:    *dst = the time-stamp counter (traces of native programs)
; kind 6 MASK:   for r < field3, j < ncols: v = src[r*lds + j]; dst[r*ldd + j] = v * mask[j];
;                fn[j] += (v != 0)  (f32 values and mask, i64 counts: an expert cache's host side
;                computes the experts the GPU does not hold and counts the routings per expert)
define void @strata_run_program(ptr %prog, i64 %n, i64 %maxc) {
entry:
  br label %loop
loop:
  %i = phi i64 [ 0, %entry ], [ %i1, %next ]
  %more = icmp slt i64 %i, %n
  br i1 %more, label %body, label %ret
body:
  %off = mul i64 %i, 10
  %ip = getelementptr i64, ptr %prog, i64 %off
  %kind = load i64, ptr %ip, align 8
  %p1 = getelementptr i64, ptr %ip, i64 1
  %p2 = getelementptr i64, ptr %ip, i64 2
  %p3 = getelementptr i64, ptr %ip, i64 3
  %p4 = getelementptr i64, ptr %ip, i64 4
  %p5 = getelementptr i64, ptr %ip, i64 5
  %p6 = getelementptr i64, ptr %ip, i64 6
  %p7 = getelementptr i64, ptr %ip, i64 7
  %p8 = getelementptr i64, ptr %ip, i64 8
  %p9 = getelementptr i64, ptr %ip, i64 9
  %fn = load ptr, ptr %p1, align 8
  %args = load ptr, ptr %p2, align 8
  %f3 = load i64, ptr %p3, align 8
  %src = load ptr, ptr %p4, align 8
  %f5 = load i64, ptr %p5, align 8
  %f6 = load i64, ptr %p6, align 8
  %dst = load ptr, ptr %p7, align 8
  %f8 = load i64, ptr %p8, align 8
  %f9 = load i64, ptr %p9, align 8
  switch i64 %kind, label %next [ i64 0, label %par
                                  i64 1, label %one
                                  i64 2, label %set
                                  i64 3, label %copy
                                  i64 4, label %gather
                                  i64 5, label %tsc
                                  i64 6, label %mask ]
par:
  %hassrc = icmp ne ptr %src, null
  br i1 %hassrc, label %pardyn, label %pargo
pardyn:
  %sv = load i64, ptr %src, align 8
  %sm = mul i64 %sv, %f5
  br label %pargo
pargo:
  %dyn = phi i64 [ 0, %par ], [ %sm, %pardyn ]
  %total = add i64 %dyn, %f3
  %pos = icmp sgt i64 %total, 0
  br i1 %pos, label %parc, label %next
parc:
  %minc = call i64 @llvm.smax.i64(i64 %f6, i64 1)
  %mc1 = sub i64 %minc, 1
  %tr = add i64 %total, %mc1
  %cdiv = sdiv i64 %tr, %minc
  %c1 = call i64 @llvm.smin.i64(i64 %maxc, i64 %total)
  %c2 = call i64 @llvm.smin.i64(i64 %c1, i64 %cdiv)
  %single = icmp sle i64 %c2, 1
  br i1 %single, label %parone, label %parmulti
parone:
  call void %fn(ptr %args, i64 0, i64 %total)
  br label %next
parmulti:
  call void @strata_parallel_for(ptr %fn, ptr %args, i64 %total, i64 %c2)
  br label %next
one:
  call void %fn(ptr %args, i64 %f3, i64 %f8)
  br label %next
set:
  %v = load i64, ptr %src, align 8
  %vm = mul i64 %v, %f5
  %va = add i64 %vm, %f3
  store i64 %va, ptr %dst, align 8
  br label %next
copy:
  call void @llvm.memcpy.p0.p0.i64(ptr %dst, ptr %src, i64 %f3, i1 false)
  br label %next
gather:
  %gatherp = inttoptr i64 %f8 to ptr
  br label %gatherrow
gatherrow:
  %gatherr = phi i64 [ 0, %gather ], [ %gatherr1, %gatherrowend ]
  %gatherrmore = icmp slt i64 %gatherr, %f3
  br i1 %gatherrmore, label %gathercols, label %next
gathercols:
  %gathersb = mul i64 %gatherr, %f5
  %gatherdb = mul i64 %gatherr, %f6
  br label %gathercol
gathercol:
  %gatherj = phi i64 [ 0, %gathercols ], [ %gatherj1, %gatherbody ]
  %gatherjmore = icmp slt i64 %gatherj, %f9
  br i1 %gatherjmore, label %gatherbody, label %gatherrowend
gatherbody:
  %ixp = getelementptr i64, ptr %gatherp, i64 %gatherj
  %ix = load i64, ptr %ixp, align 8
  %so = add i64 %gathersb, %ix
  %sp = getelementptr i32, ptr %src, i64 %so
  %val = load i32, ptr %sp, align 4
  %do = add i64 %gatherdb, %gatherj
  %dp = getelementptr i32, ptr %dst, i64 %do
  store i32 %val, ptr %dp, align 4
  %gatherj1 = add i64 %gatherj, 1
  br label %gathercol
gatherrowend:
  %gatherr1 = add i64 %gatherr, 1
  br label %gatherrow
tsc:
  %now = call i64 @llvm.readcyclecounter()
  store i64 %now, ptr %dst, align 8
  br label %next
mask:
  %maskp = inttoptr i64 %f8 to ptr
  br label %maskrow
maskrow:
  %maskr = phi i64 [ 0, %mask ], [ %maskr1, %maskrowend ]
  %maskrmore = icmp slt i64 %maskr, %f3
  br i1 %maskrmore, label %maskcols, label %next
maskcols:
  %masksb = mul i64 %maskr, %f5
  %maskdb = mul i64 %maskr, %f6
  br label %maskcol
maskcol:
  %maskj = phi i64 [ 0, %maskcols ], [ %maskj1, %maskbody ]
  %maskjmore = icmp slt i64 %maskj, %f9
  br i1 %maskjmore, label %maskbody, label %maskrowend
maskbody:
  %mso = add i64 %masksb, %maskj
  %msp = getelementptr float, ptr %src, i64 %mso
  %mv = load float, ptr %msp, align 4
  %mkp = getelementptr float, ptr %maskp, i64 %maskj
  %mkv = load float, ptr %mkp, align 4
  %mprod = fmul float %mv, %mkv
  %mdo = add i64 %maskdb, %maskj
  %mdp = getelementptr float, ptr %dst, i64 %mdo
  store float %mprod, ptr %mdp, align 4
  %mnz = fcmp une float %mv, 0.0
  %mnz64 = zext i1 %mnz to i64
  %mcp = getelementptr i64, ptr %fn, i64 %maskj
  %mc = load i64, ptr %mcp, align 8
  %mcn = add i64 %mc, %mnz64
  store i64 %mcn, ptr %mcp, align 8
  %maskj1 = add i64 %maskj, 1
  br label %maskcol
maskrowend:
  %maskr1 = add i64 %maskr, 1
  br label %maskrow
next:
  %i1 = add i64 %i, 1
  br label %loop
ret:
  ret void
}

declare i64 @llvm.smax.i64(i64, i64)
declare i64 @llvm.smin.i64(i64, i64)
declare void @llvm.memcpy.p0.p0.i64(ptr, ptr, i64, i1)

; One job at a time run by a thread of its own (the "async runner"), so that the thread that
; posts it (a fused step's host call, on XLA's thread) returns at once and launches the GPU's work
; while the CPU computes: strata_async_start(prog, n, maxc) posts a segment program, the runner
; runs it with strata_run_program (publishing its kernels to the workers as any caller does), and
; strata_async_wait() returns once it is done. Starts and waits alternate (one job outstanding);
; nothing else may publish pool jobs between them.
@g_async_prog = internal global ptr null, align 64
@g_async_n = internal global i64 0, align 8
@g_async_maxc = internal global i64 0, align 8
@g_async_req = internal global i32 0, align 64
@g_async_done = internal global i32 0, align 64
@g_async_started = internal global i32 0, align 64
@g_async_sleepers = internal global i32 0, align 64

define internal ptr @async_main(ptr %unused) {
entry:
  br label %wait
wait:
  %seen = load atomic i32, ptr @g_async_done acquire, align 4
  %req = call i32 @wait_change(ptr @g_async_req, i32 %seen, ptr @g_async_sleepers)
  %prog = load ptr, ptr @g_async_prog, align 8
  %n = load i64, ptr @g_async_n, align 8
  %maxc = load i64, ptr @g_async_maxc, align 8
  call void @strata_run_program(ptr %prog, i64 %n, i64 %maxc)
  store atomic i32 %req, ptr @g_async_done seq_cst, align 4
  br label %wait
}

define void @strata_async_start(ptr %prog, i64 %n, i64 %maxc) {
entry:
  %st = load atomic i32, ptr @g_async_started seq_cst, align 4
  %need = icmp eq i32 %st, 0
  br i1 %need, label %create, label %post
create:
  %r = call i32 @spawn(ptr @async_main)
  %spawned = icmp eq i32 %r, 0
  br i1 %spawned, label %started, label %inline
started:
  store atomic i32 1, ptr @g_async_started seq_cst, align 4
  br label %post
inline:                      ; no thread: run it here, and the wait finds it done
  call void @strata_run_program(ptr %prog, i64 %n, i64 %maxc)
  %g0 = atomicrmw add ptr @g_async_req, i32 1 seq_cst, align 4
  %g1 = add i32 %g0, 1
  store atomic i32 %g1, ptr @g_async_done seq_cst, align 4
  ret void
post:
  store ptr %prog, ptr @g_async_prog, align 8
  store i64 %n, ptr @g_async_n, align 8
  store i64 %maxc, ptr @g_async_maxc, align 8
  call void @bump(ptr @g_async_req, ptr @g_async_sleepers, i32 1)
  ret void
}

; The waiter checks, pauses, and every 64 checks yields its core (the runner and the workers may
; need all of them).
define void @strata_async_wait() {
entry:
  %want = load atomic i32, ptr @g_async_req seq_cst, align 4
  br label %loop
loop:
  %i = phi i64 [ 0, %entry ], [ %i1, %pause ], [ %i1, %yield ]
  %d = load atomic i32, ptr @g_async_done acquire, align 4
  %ok = icmp eq i32 %d, %want
  br i1 %ok, label %ret, label %pause
pause:
  call void @llvm.x86.sse2.pause()
  %i1 = add i64 %i, 1
  %low = and i64 %i1, 63
  %y = icmp eq i64 %low, 0
  br i1 %y, label %yield, label %loop
yield:
  %yr = call i32 @sched_yield()
  br label %loop
ret:
  ret void
}

; In a child after fork(): the parent's runner does not exist here.
define void @strata_async_after_fork() {
  store atomic i32 0, ptr @g_async_started seq_cst, align 4
  store atomic i32 0, ptr @g_async_sleepers seq_cst, align 4
  %d = load atomic i32, ptr @g_async_req seq_cst, align 4
  store atomic i32 %d, ptr @g_async_done seq_cst, align 4
  ret void
}

; Direct single-threaded call of a kernel (so Python needs one ctypes object, not one per kernel).
define void @strata_call(ptr %fn, ptr %args, i64 %begin, i64 %end) {
  call void %fn(ptr %args, i64 %begin, i64 %end)
  ret void
}
