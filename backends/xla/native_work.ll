; A host call's work without Python: a CPU partition's segment program run straight from the
; handler. host_call.py `native_work` substitutes the constants written as placeholders below (an
; address of 0 means "none", and the optimizer drops the code it guards).
;
; While the int64 at ${flag} is 0: before() (pool.py strata_async_wait: the part a runner thread
; computed), run_program(prog, n, *maxc) (pool.py strata_run_program, or strata_async_start to
; hand the program to the runner). While it is 2, the same with the traced program (time stamps between its ops) in
; its place. Otherwise the Python work at ${fallback}. With a timeline buffer ([on, count,
; capacity, then (tag, TSC at entry, TSC at exit) per call]) whose first word is set, each
; native call appends its record.

define void @${name}(i64 %arg, ptr %stream) {
entry:
  %f = load volatile i64, ptr inttoptr (i64 ${flag} to ptr), align 8
  %tr = icmp eq i64 %f, 2
  %hastr = icmp ne i64 ${traced}, 0
  %trok = and i1 %tr, %hastr
  %plain = icmp eq i64 %f, 0
  %go = or i1 %plain, %trok
  %p = select i1 %trok, i64 ${traced}, i64 ${prog}
  %pn = select i1 %trok, i64 ${traced_n}, i64 ${n}
  br i1 %go, label %native, label %python
python:
  call void inttoptr (i64 ${fallback} to ptr)(i64 %arg, ptr %stream)
  ret void
native:
  %m = load volatile i64, ptr inttoptr (i64 ${maxc} to ptr), align 8
  %t0 = call i64 @llvm.readcyclecounter()
  %hasbefore = icmp ne i64 ${before}, 0
  br i1 %hasbefore, label %before, label %run
before:
  call void inttoptr (i64 ${before} to ptr)()
  br label %run
run:
  %pp = inttoptr i64 %p to ptr
  call void inttoptr (i64 ${run_program} to ptr)(ptr %pp, i64 %pn, i64 %m)
  br label %ran
ran:
  %t1 = call i64 @llvm.readcyclecounter()
  %hastl = icmp ne i64 ${timeline}, 0
  br i1 %hastl, label %tl, label %done
tl:
  %tlp = inttoptr i64 ${timeline} to ptr
  %on = load volatile i64, ptr %tlp, align 8
  %rec = icmp ne i64 %on, 0
  br i1 %rec, label %add, label %done
add:
  %cp = getelementptr i64, ptr %tlp, i64 1
  %capp = getelementptr i64, ptr %tlp, i64 2
  %i = atomicrmw add ptr %cp, i64 1 seq_cst, align 8
  %cap = load i64, ptr %capp, align 8
  %fits = icmp slt i64 %i, %cap
  br i1 %fits, label %store, label %done
store:
  %o = mul i64 %i, 3
  %o3 = add i64 %o, 3
  %e0 = getelementptr i64, ptr %tlp, i64 %o3
  store i64 ${tag}, ptr %e0, align 8
  %e1 = getelementptr i64, ptr %e0, i64 1
  store i64 %t0, ptr %e1, align 8
  %e2 = getelementptr i64, ptr %e0, i64 2
  store i64 %t1, ptr %e2, align 8
  br label %done
done:
  ret void
}

declare i64 @llvm.readcyclecounter()
