//! A [`DemandImage`] served as one file of a FUSE mount, for guest memory
//! QEMU maps with `-object memory-backend-file,share=on,mem-path=FILE`
//! (issue 14: lazy memory at a `roam resume --vm --demand-fetch`; see
//! `scripts/isr-lazy-memory/README.md` for the prototype's measurements).
//!
//! A page fault in QEMU's mapping reaches [`MemoryFs::read`]; the chunks it
//! touches are fetched (verified) through the image as the NBD server's
//! reads are; writes back from the page cache (at the latest when QEMU
//! closes the file) go to [`DemandImage::write`] and mark chunks dirty.
//!
//! Speculative readahead is refused: QEMU madvises guest RAM
//! `MADV_HUGEPAGE`, and the kernel then reads around 2 MiB on every fault of
//! a file mapping (16 chunks for one page), whatever the mount's
//! readahead settings. A read longer than one page that touches a chunk not
//! yet present is answered `EIO`; a failed readahead only leaves those
//! pages not up to date, and the fault then reads its own page alone, so
//! only that page's chunk is fetched. Reads of present chunks are answered
//! in full.
//!
//! Requests are served one at a time on the FUSE session's thread (it
//! blocks on the tokio runtime for a fetch): the guest's faults come from
//! one vCPU thread under TCG anyway.
//!
//! Non-goals: more than one file per mount, directories, permissions other
//! than the owner's.

use std::ffi::OsStr;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use fuser::{
    FileAttr, FileType, Filesystem, MountOption, ReplyAttr, ReplyData, ReplyDirectory, ReplyEmpty,
    ReplyEntry, ReplyOpen, ReplyWrite, Request, TimeOrNow,
};

use super::DemandImage;

/// The root directory's inode (FUSE's fixed number).
const ROOT: u64 = 1;
/// The one file's inode.
const FILE: u64 = 2;
/// How long the kernel may cache names and attributes (1 h: nothing
/// changes them but this server).
const TTL: Duration = Duration::from_secs(3600);
/// The page size a fault reads when readahead was refused (4 KiB).
const PAGE: u32 = 4096;

/// The file system: one file, the image.
struct MemoryFs {
    image: Arc<DemandImage>,
    /// The runtime the image's fetches run on.
    rt: tokio::runtime::Handle,
    /// Owner of the file (the mounting user).
    uid: u32,
    gid: u32,
}

impl MemoryFs {
    fn attr(&self, ino: u64) -> FileAttr {
        let dir = ino == ROOT;
        let size = if dir { 0 } else { self.image.len() };
        FileAttr {
            ino,
            size,
            blocks: size.div_ceil(512),
            atime: SystemTime::UNIX_EPOCH,
            mtime: SystemTime::UNIX_EPOCH,
            ctime: SystemTime::UNIX_EPOCH,
            crtime: SystemTime::UNIX_EPOCH,
            kind: if dir {
                FileType::Directory
            } else {
                FileType::RegularFile
            },
            perm: if dir { 0o700 } else { 0o600 },
            nlink: if dir { 2 } else { 1 },
            uid: self.uid,
            gid: self.gid,
            rdev: 0,
            blksize: PAGE,
            flags: 0,
        }
    }

    /// `[offset, offset + size)` clipped to the image.
    fn span(&self, offset: i64, size: u64) -> Option<(u64, u64)> {
        let offset = u64::try_from(offset).ok()?;
        let end = offset.saturating_add(size).min(self.image.len());
        (offset <= end).then_some((offset, end - offset))
    }
}

impl Filesystem for MemoryFs {
    fn lookup(&mut self, _req: &Request<'_>, parent: u64, name: &OsStr, reply: ReplyEntry) {
        if parent == ROOT && name == OsStr::new(self.image.name()) {
            reply.entry(&TTL, &self.attr(FILE), 0);
        } else {
            reply.error(nix::libc::ENOENT);
        }
    }

    fn getattr(&mut self, _req: &Request<'_>, ino: u64, _fh: Option<u64>, reply: ReplyAttr) {
        match ino {
            ROOT | FILE => reply.attr(&TTL, &self.attr(ino)),
            _ => reply.error(nix::libc::ENOENT),
        }
    }

    fn setattr(
        &mut self,
        _req: &Request<'_>,
        ino: u64,
        _mode: Option<u32>,
        _uid: Option<u32>,
        _gid: Option<u32>,
        size: Option<u64>,
        _atime: Option<TimeOrNow>,
        _mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        _fh: Option<u64>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<u32>,
        reply: ReplyAttr,
    ) {
        // The image's length is the guest's memory size: it never changes.
        if ino != FILE || size.is_some_and(|s| s != self.image.len()) {
            return reply.error(nix::libc::EPERM);
        }
        reply.attr(&TTL, &self.attr(ino));
    }

    fn open(&mut self, _req: &Request<'_>, ino: u64, _flags: i32, reply: ReplyOpen) {
        if ino != FILE {
            return reply.error(nix::libc::EISDIR);
        }
        // Keep the page cache across opens: it holds the guest's pages.
        reply.opened(0, fuser::consts::FOPEN_KEEP_CACHE);
    }

    fn read(
        &mut self,
        _req: &Request<'_>,
        ino: u64,
        _fh: u64,
        offset: i64,
        size: u32,
        _flags: i32,
        _lock_owner: Option<u64>,
        reply: ReplyData,
    ) {
        let Some((offset, len)) = self.span(offset, u64::from(size)).filter(|_| ino == FILE) else {
            return reply.error(nix::libc::EINVAL);
        };
        if size > PAGE && !self.image.all_present(offset, len) {
            // Speculative readahead (module docs).
            return reply.error(nix::libc::EIO);
        }
        // `len` is at most `size`, a u32.
        let len = u32::try_from(len).unwrap_or(size);
        match self.rt.block_on(self.image.read(offset, len)) {
            Ok(bytes) => reply.data(&bytes),
            Err(e) => {
                (self.image.report)(&format!(
                    "FUSE read of {len} bytes at offset {offset} of {} failed (an I/O error, \
                     SIGBUS for QEMU, never the data): {e}",
                    self.image.name()
                ));
                reply.error(nix::libc::EIO)
            }
        }
    }

    fn write(
        &mut self,
        _req: &Request<'_>,
        ino: u64,
        _fh: u64,
        offset: i64,
        data: &[u8],
        _write_flags: u32,
        _flags: i32,
        _lock_owner: Option<u64>,
        reply: ReplyWrite,
    ) {
        let Some((offset, len)) = self
            .span(offset, data.len() as u64)
            .filter(|&(_, len)| ino == FILE && len == data.len() as u64)
        else {
            // Past the end: the file does not grow.
            return reply.error(nix::libc::ENOSPC);
        };
        match self.rt.block_on(self.image.write(offset, len, Some(data))) {
            Ok(()) => reply.written(data.len() as u32),
            Err(e) => {
                (self.image.report)(&format!(
                    "FUSE write of {len} bytes at offset {offset} of {} failed: {e}",
                    self.image.name()
                ));
                reply.error(nix::libc::EIO)
            }
        }
    }

    fn flush(&mut self, _req: &Request<'_>, _ino: u64, _fh: u64, _lock: u64, reply: ReplyEmpty) {
        reply.ok();
    }

    fn fsync(&mut self, _req: &Request<'_>, _ino: u64, _fh: u64, _data: bool, reply: ReplyEmpty) {
        match self.image.flush() {
            Ok(()) => reply.ok(),
            Err(_) => reply.error(nix::libc::EIO),
        }
    }

    fn readdir(
        &mut self,
        _req: &Request<'_>,
        ino: u64,
        _fh: u64,
        offset: i64,
        mut reply: ReplyDirectory,
    ) {
        if ino != ROOT {
            return reply.error(nix::libc::ENOTDIR);
        }
        let entries = [
            (ROOT, FileType::Directory, "."),
            (ROOT, FileType::Directory, ".."),
            (FILE, FileType::RegularFile, self.image.name()),
        ];
        for (i, (ino, kind, name)) in entries.iter().enumerate().skip(offset.max(0) as usize) {
            if reply.add(*ino, i as i64 + 1, *kind, name) {
                break;
            }
        }
        reply.ok();
    }
}

/// A mounted [`DemandImage`]; unmounted when dropped.
pub(crate) struct MemoryMount {
    /// The FUSE session; dropping it unmounts (`None` once dropped).
    session: Option<fuser::BackgroundSession>,
    /// Where it is mounted.
    mountpoint: std::path::PathBuf,
}

impl Drop for MemoryMount {
    /// Unmounts. The FUSE library's own unmount is one `umount`, which
    /// fails with `EBUSY` while the kernel still holds a file of the mount
    /// (a descriptor closed a moment ago, or inherited by a child between
    /// its `fork` and `exec`) and then leaves the mount in place: seen once
    /// in a CI run. A busy mount is tried again every 10 ms for up to
    /// 0.5 s, then detached (`MNT_DETACH`: gone from the tree at once,
    /// released when its last file closes).
    fn drop(&mut self) {
        drop(self.session.take());
        use nix::mount::{umount2, MntFlags};
        for _ in 0..50 {
            if !is_mounted(&self.mountpoint) {
                return;
            }
            match umount2(&self.mountpoint, MntFlags::empty()) {
                Ok(()) => return,
                Err(nix::errno::Errno::EBUSY) => std::thread::sleep(Duration::from_millis(10)),
                // Not mounted any more, or not ours to unmount.
                Err(_) => return,
            }
        }
        let _ = umount2(&self.mountpoint, MntFlags::MNT_DETACH);
    }
}

/// Whether `path` is a mount point in this process's mount namespace
/// (`/proc/self/mountinfo`, whose fifth field is the mount point with
/// space, tab, newline and backslash written as octal escapes).
pub(crate) fn is_mounted(path: &Path) -> bool {
    let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return false;
    };
    !crate::store::leftovers::mounts_at(&info, path).is_empty()
}

/// Mounts `image` as the one file `mountpoint/<image name>` (`mountpoint`
/// must be an existing empty directory); fetches run on `rt`. Mounting
/// needs /dev/fuse and the right to mount (root, or fusermount3 installed).
pub(crate) fn mount(
    image: Arc<DemandImage>,
    mountpoint: &Path,
    rt: tokio::runtime::Handle,
) -> Result<MemoryMount, String> {
    let fs = MemoryFs {
        image,
        rt,
        uid: nix::unistd::getuid().as_raw(),
        gid: nix::unistd::getgid().as_raw(),
    };
    let options = [
        MountOption::FSName("roam-memory".into()),
        MountOption::RW,
        MountOption::NoDev,
        MountOption::NoSuid,
    ];
    let session = fuser::spawn_mount2(fs, mountpoint, &options).map_err(|e| {
        format!(
            "cannot mount the guest memory's FUSE file system on {}: {e} (it needs /dev/fuse and \
             the right to mount: root, or fusermount3 from Debian's fuse3)",
            mountpoint.display()
        )
    })?;
    Ok(MemoryMount {
        session: Some(session),
        mountpoint: mountpoint.to_path_buf(),
    })
}
