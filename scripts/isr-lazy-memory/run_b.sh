#!/bin/bash
# A resume at site B in $P/b: the guest RAM file served by the prototype over FUSE
# (mem-path=$P/b/mnt/ram, share=on), QEMU loads the device-state-only
# migration stream (x-ignore-shared) and continues; prints the time from the
# start to the guest's first console tick. $P/src-ram, $P/sizes, $P/a/disk.img
# come from site A (README.md).
# usage: run_b.sh MBIT FILL_AFTER_MS DEVSTATE [env...]; prints seconds to the first tick after the resume
P=${P:-/tmp/isrp}; G=${ROAM_GUEST:?run scripts/guest-build}; MB=$1; FA=$2; DS=$3
umount $P/b/mnt 2>/dev/null; cp $P/a/disk.img $P/b/disk.img; rm -f $P/b/serial $P/b/qmp.sock
T0=$(date +%s.%N)
(TRACE=1 ${BIN:-target/release/isr-lazy-memory-proto} $P/src-ram $P/b/cache $P/b/mnt $MB $FA $P/sizes < <(sleep 10) 2> $P/b/fuse.log &)
for i in $(seq 100); do mount | grep -q roamproto && break; sleep 0.01; done
if [ -n "$RA_KB" ]; then D=$(mountpoint -d $P/b/mnt); echo $RA_KB > /sys/class/bdi/$D/read_ahead_kb; cat /sys/class/bdi/$D/read_ahead_kb; fi
if [ -n "$COPYIN" ]; then for i in $(seq 1000); do grep -q "fill done" $P/b/fuse.log && break; sleep 0.01; done; fi
qemu-system-x86_64 -m 128 -object memory-backend-file,id=mem,size=128M,mem-path=$P/b/mnt/ram,share=on -machine memory-backend=mem -nodefaults -display none -no-reboot -kernel $G/vmlinuz -initrd $G/initrd.gz -append "console=ttyS0 quiet panic=-1" -drive file=$P/b/disk.img,format=raw,if=virtio -serial file:$P/b/serial -qmp unix:$P/b/qmp.sock,server=on,wait=off -pidfile $P/b/qemu.pid -incoming defer 2> $P/b/qemu.err &
QP=$!
python3 "$(dirname "$0")"/qmp.py load $P/b/qmp.sock $DS 2>$P/b/load.log
for i in $(seq 600); do grep -q "tick" $P/b/serial 2>/dev/null && break; sleep 0.02; done; T1=$(date +%s.%N)
echo "first tick $(echo "$T1 - $T0" | bc) s; $(cat $P/b/load.log | tr '\n' ' '); $(head -1 $P/b/serial)"
sleep 3; kill $QP; wait $QP 2>/dev/null
for i in $(seq 200); do mount | grep -q roamproto || break; sleep 0.2; done
grep -E "demand" $P/b/fuse.log | tail -1
