//! Measurement prototype (issue 14, lazy guest memory): serves one file `ram`
//! over FUSE, "fetched" lazily from SRC in 128 KiB chunks over a simulated
//! link, with a background fill. Not product code: no store, no hashes.
//!
//! Usage: isr-lazy-memory-proto SRC CACHE MOUNTPOINT MBIT FILL_AFTER_MS SIZES
//!   SRC    the guest's memory file as it was at the suspend site
//!   CACHE  local file the fetched chunks go into (the FUSE file's content)
//!   SIZES  a line per chunk: "<bytes on the wire> <1 if all zero>" (zlib-1
//!          size + 60 stands in for the store's zstd-3 sealed object)
//! Environment: RTT_US (per fetch, default 1000), PAR (fill requests in
//! flight, default 1), ORDER (file of chunk indices the fill takes first),
//! REFUSE_RA (answer EIO to a read of more than one page that touches an
//! absent chunk: speculative readahead; the faulting page is then read
//! alone), TRACE (log every read), MAX_RA (max_readahead offered at init).
//! Runs until stdin closes, then unmounts.
use fuser::*;
use std::ffi::OsStr;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

const CHUNK: u64 = 128 * 1024;
struct State {
    src: File,
    cache: File,
    present: Vec<bool>,
    demand: u64,
    bg: u64,
    dirty: Vec<bool>,
    writes: u64,
    refused: u64,
}
struct Link {
    mbit: f64,
    rtt: Duration,
    wire: Mutex<()>,
    clen: Vec<u64>,
    zero: Vec<bool>,
}
struct Fs {
    st: Arc<Mutex<State>>,
    size: u64,
    link: Arc<Link>,
    t0: Instant,
}

fn ensure(st: &mut State, link: &Link, c: u64, demand: bool) {
    if st.present[c as usize] {
        return;
    }
    if !link.zero[c as usize] {
        std::thread::sleep(link.rtt);
        let _w = link.wire.lock().unwrap();
        std::thread::sleep(Duration::from_secs_f64(
            link.clen[c as usize] as f64 * 8.0 / (link.mbit * 1e6),
        ));
    }
    let mut buf = vec![0u8; CHUNK as usize];
    let n = st.src.read_at(&mut buf, c * CHUNK).unwrap();
    st.cache.write_all_at(&buf[..n], c * CHUNK).unwrap();
    st.present[c as usize] = true;
    if demand {
        st.demand += 1
    } else {
        st.bg += 1
    }
}

fn attr(ino: u64, size: u64) -> FileAttr {
    let dir = ino == 1;
    FileAttr {
        ino,
        size: if dir { 0 } else { size },
        blocks: size / 512,
        atime: SystemTime::UNIX_EPOCH,
        mtime: SystemTime::UNIX_EPOCH,
        ctime: SystemTime::UNIX_EPOCH,
        crtime: SystemTime::UNIX_EPOCH,
        kind: if dir {
            FileType::Directory
        } else {
            FileType::RegularFile
        },
        perm: if dir { 0o755 } else { 0o600 },
        nlink: 1,
        uid: 0,
        gid: 0,
        rdev: 0,
        blksize: 4096,
        flags: 0,
    }
}
const TTL: Duration = Duration::from_secs(3600);
impl Filesystem for Fs {
    fn init(&mut self, _r: &Request<'_>, config: &mut KernelConfig) -> Result<(), libc::c_int> {
        if let Ok(v) = std::env::var("MAX_RA") {
            eprintln!(
                "set_max_readahead {:?}",
                config.set_max_readahead(v.parse().unwrap())
            );
        }
        Ok(())
    }
    fn lookup(&mut self, _r: &Request<'_>, parent: u64, name: &OsStr, reply: ReplyEntry) {
        if parent == 1 && name == "ram" {
            reply.entry(&TTL, &attr(2, self.size), 0)
        } else {
            reply.error(libc::ENOENT)
        }
    }
    fn getattr(&mut self, _r: &Request<'_>, ino: u64, _fh: Option<u64>, reply: ReplyAttr) {
        if ino <= 2 {
            reply.attr(&TTL, &attr(ino, self.size))
        } else {
            reply.error(libc::ENOENT)
        }
    }
    fn setattr(
        &mut self,
        _r: &Request<'_>,
        ino: u64,
        _m: Option<u32>,
        _u: Option<u32>,
        _g: Option<u32>,
        size: Option<u64>,
        _a: Option<TimeOrNow>,
        _mt: Option<TimeOrNow>,
        _c: Option<SystemTime>,
        _fh: Option<u64>,
        _cr: Option<SystemTime>,
        _ch: Option<SystemTime>,
        _b: Option<SystemTime>,
        _f: Option<u32>,
        reply: ReplyAttr,
    ) {
        if size.is_some_and(|s| s != self.size) {
            eprintln!("setattr size {size:?}");
            return reply.error(libc::EPERM);
        }
        reply.attr(&TTL, &attr(ino, self.size))
    }
    fn open(&mut self, _r: &Request<'_>, _ino: u64, _flags: i32, reply: ReplyOpen) {
        reply.opened(0, consts::FOPEN_KEEP_CACHE)
    }
    fn read(
        &mut self,
        r: &Request<'_>,
        _ino: u64,
        _fh: u64,
        offset: i64,
        size: u32,
        _f: i32,
        _l: Option<u64>,
        reply: ReplyData,
    ) {
        let off = offset as u64;
        let end = (off + size as u64).min(self.size);
        let mut st = self.st.lock().unwrap();
        if std::env::var_os("TRACE").is_some() {
            eprintln!(
                "{:.3} read pid {} off {:#x} size {}",
                self.t0.elapsed().as_secs_f64(),
                r.pid(),
                off,
                size
            );
        }
        if size > 4096
            && std::env::var_os("REFUSE_RA").is_some()
            && (off / CHUNK..end.div_ceil(CHUNK)).any(|c| !st.present[c as usize])
        {
            st.refused += 1;
            return reply.error(libc::EIO);
        }
        for c in off / CHUNK..end.div_ceil(CHUNK) {
            ensure(&mut st, &self.link, c, true);
        }
        let mut buf = vec![0u8; (end - off) as usize];
        st.cache.read_exact_at(&mut buf, off).unwrap();
        reply.data(&buf);
    }
    fn write(
        &mut self,
        _r: &Request<'_>,
        _ino: u64,
        _fh: u64,
        offset: i64,
        data: &[u8],
        _wf: u32,
        _f: i32,
        _l: Option<u64>,
        reply: ReplyWrite,
    ) {
        let off = offset as u64;
        let end = off + data.len() as u64;
        let mut st = self.st.lock().unwrap();
        for c in off / CHUNK..end.div_ceil(CHUNK) {
            ensure(&mut st, &self.link, c, true);
            st.dirty[c as usize] = true;
        }
        st.cache.write_all_at(data, off).unwrap();
        st.writes += 1;
        reply.written(data.len() as u32)
    }
    fn flush(&mut self, _r: &Request<'_>, _i: u64, _fh: u64, _l: u64, reply: ReplyEmpty) {
        reply.ok()
    }
    fn fsync(&mut self, _r: &Request<'_>, _i: u64, _fh: u64, _d: bool, reply: ReplyEmpty) {
        reply.ok()
    }
    fn readdir(
        &mut self,
        _r: &Request<'_>,
        _ino: u64,
        _fh: u64,
        offset: i64,
        mut reply: ReplyDirectory,
    ) {
        if offset == 0 {
            let _ = reply.add(2, 1, FileType::RegularFile, "ram");
        }
        reply.ok()
    }
    fn destroy(&mut self) {
        let st = self.st.lock().unwrap();
        eprintln!(
            "fuse: {:.2}s demand {} bg {} dirty {} writes {}",
            self.t0.elapsed().as_secs_f64(),
            st.demand,
            st.bg,
            st.dirty.iter().filter(|d| **d).count(),
            st.writes
        );
    }
}

fn main() {
    let a: Vec<String> = std::env::args().collect();
    let (src, cache, mnt) = (&a[1], &a[2], &a[3]);
    let mbit: f64 = a[4].parse().unwrap();
    let fill_after: u64 = a[5].parse().unwrap();
    let src = File::open(src).unwrap();
    let size = src.metadata().unwrap().len();
    let cache = File::options()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(cache)
        .unwrap();
    cache.set_len(size).unwrap();
    let n = size.div_ceil(CHUNK) as usize;
    let st = Arc::new(Mutex::new(State {
        src,
        cache,
        present: vec![false; n],
        demand: 0,
        bg: 0,
        dirty: vec![false; n],
        writes: 0,
        refused: 0,
    }));
    let sizes: Vec<(u64, bool)> = std::fs::read_to_string(&a[6])
        .unwrap()
        .lines()
        .map(|l| {
            let mut f = l.split(' ');
            (f.next().unwrap().parse().unwrap(), f.next().unwrap() == "1")
        })
        .collect();
    let link = Arc::new(Link {
        mbit,
        rtt: Duration::from_micros(
            std::env::var("RTT_US")
                .map(|v| v.parse().unwrap())
                .unwrap_or(1000),
        ),
        wire: Mutex::new(()),
        clen: sizes.iter().map(|s| s.0).collect(),
        zero: sizes.iter().map(|s| s.1).collect(),
    });
    let order: Vec<u64> = match std::env::var("ORDER") {
        Ok(f) => std::fs::read_to_string(f)
            .unwrap()
            .lines()
            .map(|l| l.parse().unwrap())
            .collect(),
        Err(_) => Vec::new(),
    };
    let t0 = Instant::now();
    let fs = Fs {
        st: st.clone(),
        size,
        link: link.clone(),
        t0,
    };
    let sess = spawn_mount2(
        fs,
        mnt,
        &[
            MountOption::FSName("roamproto".into()),
            MountOption::RW,
            MountOption::AllowOther,
        ],
    )
    .unwrap();
    eprintln!("mounted {mnt} size {size}");
    let mut seq: Vec<u64> = order.clone();
    seq.extend(0..n as u64);
    let queue = Arc::new(Mutex::new(std::collections::VecDeque::from(seq)));
    let par: usize = std::env::var("PAR")
        .map(|v| v.parse().unwrap())
        .unwrap_or(1);
    let left = Arc::new(std::sync::atomic::AtomicUsize::new(par));
    for _ in 0..par {
        let (st2, link2, queue, left) = (st.clone(), link.clone(), queue.clone(), left.clone());
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(fill_after));
            loop {
                let Some(c) = queue.lock().unwrap().pop_front() else {
                    break;
                };
                if st2.lock().unwrap().present[c as usize] {
                    continue;
                }
                if !link2.zero[c as usize] {
                    std::thread::sleep(link2.rtt);
                    let _w = link2.wire.lock().unwrap();
                    std::thread::sleep(Duration::from_secs_f64(
                        link2.clen[c as usize] as f64 * 8.0 / (link2.mbit * 1e6),
                    ));
                }
                let mut s = st2.lock().unwrap();
                if s.present[c as usize] {
                    continue;
                }
                let mut buf = vec![0u8; CHUNK as usize];
                let k = s.src.read_at(&mut buf, c * CHUNK).unwrap();
                s.cache.write_all_at(&buf[..k], c * CHUNK).unwrap();
                s.present[c as usize] = true;
                s.bg += 1;
            }
            if left.fetch_sub(1, std::sync::atomic::Ordering::SeqCst) == 1 {
                eprintln!("fill done at {:.2}s", t0.elapsed().as_secs_f64());
            }
        });
    }
    // run until stdin closes
    let st3 = st.clone();
    std::thread::spawn(move || loop {
        std::thread::sleep(Duration::from_millis(500));
        let s = st3.lock().unwrap();
        eprintln!(
            "{:.2}s demand {} bg {} dirty {} refused {}",
            t0.elapsed().as_secs_f64(),
            s.demand,
            s.bg,
            s.dirty.iter().filter(|d| **d).count(),
            s.refused
        );
    });
    let mut s = String::new();
    let _ = std::io::stdin().read_line(&mut s);
    {
        let st = st.lock().unwrap();
        eprintln!(
            "at exit: {:.2}s demand {} bg {} dirty {} writes {}",
            t0.elapsed().as_secs_f64(),
            st.demand,
            st.bg,
            st.dirty.iter().filter(|d| **d).count(),
            st.writes
        );
    }
    drop(sess);
}
