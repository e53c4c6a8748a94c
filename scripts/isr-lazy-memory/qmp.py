import socket, json, sys, time
def conn(path):
    for _ in range(200):
        try:
            s = socket.socket(socket.AF_UNIX); s.connect(path); break
        except OSError: time.sleep(0.02)
    f = s.makefile('rw'); f.readline()
    def cmd(name, **args):
        f.write(json.dumps({"execute": name, "arguments": args}) + "\n"); f.flush()
        while True:
            r = json.loads(f.readline())
            if "event" in r: continue
            if "error" in r: raise SystemExit(f"{name}: {r}")
            return r["return"]
    cmd("qmp_capabilities")
    return cmd
def wait_mig(cmd):
    while True:
        st = cmd("query-migrate")
        if st.get("status") in ("completed", "failed"): return st
        time.sleep(0.01)
if __name__ == "__main__":
    op, sock = sys.argv[1], sys.argv[2]
    t0 = time.time()
    cmd = conn(sock)
    if op == "save":
        cmd("migrate-set-capabilities", capabilities=[{"capability": "x-ignore-shared", "state": True}])
        cmd("stop")
        cmd("migrate", uri="exec:cat > " + sys.argv[3])
        st = wait_mig(cmd); print("save", st.get("status"), st.get("ram", {}).get("transferred"), file=sys.stderr)
        cmd("quit")
    elif op == "load":
        cmd("migrate-set-capabilities", capabilities=[{"capability": "x-ignore-shared", "state": True}])
        cmd("migrate-incoming", uri="exec:cat " + sys.argv[3])
        st = wait_mig(cmd); print("load", st.get("status"), "%.3f" % (time.time()-t0), file=sys.stderr)
        cmd("cont"); print("cont at %.3f" % (time.time()-t0), file=sys.stderr)
