S=$(cd "$(dirname "$0")" && pwd)/run_b.sh
cd ${P:-/tmp/isrp}
export BIN=${BIN:?the prototype binary} ROAM_GUEST=${ROAM_GUEST:?run scripts/guest-build}
for r in 1 2 3; do
 echo "== copy-in (fill all, 8 in flight, then QEMU) load $(cut -d' ' -f1 /proc/loadavg)"; COPYIN=1 PAR=8 $S 100 0 a/devstate | head -1
 echo "== lazy, kernel readahead, fill 8 in flight from start load $(cut -d' ' -f1 /proc/loadavg)"; PAR=8 $S 100 0 a/devstate | head -1; grep "at exit" b/fuse.log
 echo "== lazy, readahead refused, no fill load $(cut -d' ' -f1 /proc/loadavg)"; REFUSE_RA=1 $S 100 60000 a/devstate | head -1; grep "at exit" b/fuse.log
 echo "== lazy, readahead refused, fill 1 in flight from start load $(cut -d' ' -f1 /proc/loadavg)"; REFUSE_RA=1 PAR=1 $S 100 0 a/devstate | head -1; grep "at exit\|fill done" b/fuse.log
 echo "== lazy, readahead refused, fill 8 in flight from start load $(cut -d' ' -f1 /proc/loadavg)"; REFUSE_RA=1 PAR=8 $S 100 0 a/devstate | head -1; grep "at exit\|fill done" b/fuse.log
done
