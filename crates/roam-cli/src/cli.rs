//! Command-line interface: argument definitions (with examples in every
//! `--help`), logging setup and dispatch.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};

use crate::config::FileConfig;

/// Keeps TCP sessions alive across Wi-Fi drops, laptop sleep and address changes.
///
/// A `roam serve` relay runs next to the services (like rocks' rockd); clients
/// reach them through it with `roam pipe` (e.g. as an ssh ProxyCommand) or
/// `roam forward`. When the network goes away the session suspends instead of
/// failing, and resumes — exactly once, in order — when the client can reach
/// the relay again, from any address.
///
/// Configuration file (TOML, `--config FILE`, default
/// `~/.config/roam/config.toml`); every key is optional and flags win:
///
///   state_dir = "/home/me/.local/state/roam"
///
///   [serve]
///   listen = "0.0.0.0:7447"
///   allow = ["127.0.0.1:22", "127.0.0.1:5432"]
///   key = "/etc/roam/server.key"
///   authorized_keys = "/etc/roam/authorized_keys"
///   suspend_timeout = "3d"
///   idle_suspend_timeout = "60s"
///   park_after = "10s"
///   max_connections = 1024
///   max_sessions = 4096
///   max_sessions_per_ip = 128
///   max_sessions_per_key = 128
///   max_targets = 8192
///   max_targets_per_session = 256
///   metrics = "127.0.0.1:9447"
///
///   [store]             # suspend, resume, store
///   location = "s3://my-bucket"   # or a directory
///   s3_endpoint = "https://s3.example"
///   s3_region = "us-east-1"
///   secret = "/home/me/.local/state/roam/store.secret"
///
///   [client]            # pipe and forward
///   key = "/home/me/.local/state/roam/client.key"
///   fallback = "auto"   # or "always", "never" (see `roam pipe --help`)
///
/// State (keys, known_servers, control sockets) lives in `$ROAM_STATE_DIR`, or
/// `$XDG_STATE_HOME/roam`, or `~/.local/state/roam`.
#[derive(Debug, Parser)]
#[command(
    name = "roam",
    version,
    verbatim_doc_comment,
    after_help = "\
Examples:
  roam demo                                   # see a session survive a dead link
  roam serve                                  # relay on :7447 to 127.0.0.1:22 only
  ssh -o ProxyCommand='roam pipe %h %p' host  # ssh that survives network changes
  roam forward relay 127.0.0.1:5433 127.0.0.1:5432
  roam suspend --env laptop disk.img memory.img   # into an encrypted store; `roam resume` anywhere
  roam status"
)]
pub(crate) struct Cli {
    /// Configuration file (TOML). Default: ~/.config/roam/config.toml if it exists.
    #[arg(long, global = true, value_name = "FILE")]
    pub(crate) config: Option<PathBuf>,
    /// More log output (-v: info, -vv: debug). `RUST_LOG` overrides.
    #[arg(short, long, global = true, action = clap::ArgAction::Count)]
    pub(crate) verbose: u8,
    #[command(subcommand)]
    pub(crate) command: Command,
}

#[derive(Debug, Subcommand)]
pub(crate) enum Command {
    /// Run a relay (rockd): accept roam sessions and connect their streams to allowed targets.
    #[command(after_help = "\
Examples:
  roam serve                                       # 0.0.0.0:7447, target 127.0.0.1:22 only
  roam serve --allow 127.0.0.1:22 --allow 127.0.0.1:5432
  roam serve --listen 127.0.0.1:7447 --authorized-keys ~/.config/roam/authorized_keys
  roam serve --suspend-timeout 12h
  roam serve --max-sessions-per-ip 16 --max-targets-per-session 32

Each stream names its target as `host:port`; only targets on the allow-list
are connected (`*` matches any host or any port, e.g. `127.0.0.1:*`). Others
are refused with a stream reset (code 0x101) and a log line. The target
connection stays open while its client is suspended, and closes when the
session ends (closed, or expired after --suspend-timeout).

Limits: at start-up the open-file limit is raised to its hard limit, and the
default caps are derived from it so that clients, busy answers and targets
never exhaust it. Over a connection or session cap a client is answered
\"busy\" at once; a stream over a target cap is reset with code 0x104.
`roam status` shows each cap and its use.

Upgrades and restarts without dropping sessions: start the new binary with
`roam serve --takeover` (same options), or send the running relay SIGUSR2 (it
starts `roam serve --takeover` from its own executable path, as nginx does).
The running relay stops accepting and hands the new process, over
--takeover-socket, its listening socket and then its sessions, 32 at a time
while the others keep running: each with its state, the bytes in flight, its
target connections and its client's connection. Then it exits. Clients see
a pause of a few milliseconds, no reconnect; target connections are never
closed or reset; every byte is delivered once. Shells
(--shell) move too, with their screens; their clients re-attach by
themselves (a shell's exit status is lost once it moved). A new process
whose state format differs is refused with an error naming both versions and
the running relay keeps serving. What still loses sessions: kill -9 or a crash
of the relay (its sessions' state lives only in its memory; clients are told
the session is unknown and their target connections close), and a reboot.")]
    Serve(Box<ServeArgs>),
    /// Connect stdin/stdout to TARGET through the relay on HOST (for ssh ProxyCommand).
    #[command(after_help = "\
Examples:
  ssh -o ProxyCommand='roam pipe %h %p' host    # %p=22 -> target 127.0.0.1:22 on the relay
  roam pipe relay.example 22                    # relay port 7447, target 127.0.0.1:22
  roam pipe relay.example:9000 db.internal:5432 # relay on port 9000, target as the relay sees it

TARGET is `PORT` (meaning 127.0.0.1:PORT as seen from the relay) or `HOST:PORT`.
If HOST runs no roam relay (connection refused, or another protocol answers),
roam warns once on stderr and connects directly to HOST:PORT instead (for a
loopback TARGET) or to TARGET itself, without session protection and without
roam's encryption. It never does that for a relay whose key is pinned in
known_servers (an attacker could otherwise turn a pinned relay into a plain
connection by blocking it), unless --fallback always; --no-fallback (or
--fallback never) forbids it altogether.

On SIGHUP (ssh sends it on exit), SIGINT or SIGTERM roam finishes the stream,
closes the session (waiting at most 3 s for the relay) and exits 128+signal.
While the relay is unreachable the session stays suspended and roam says so
on stderr; it resumes by itself when the relay can be reached again.
The two directions end on their own: after the target has finished sending,
roam goes on sending stdin until its end. If the target then stops reading
(it resets the connection) roam says so on stderr and exits 0, as socat and
nc do; if the session or connection is lost instead, that is an error.

Named sessions outlive the process: with --name N, SIGHUP, SIGINT, SIGTERM
or `roam detach N` detach the session instead of closing it. The relay keeps
it (and its target connection) suspended; roam writes its client state (keys,
offsets, unacknowledged bytes, and any bytes taken from stdin but not yet
sent or received but not yet printed) to the state directory (sessions/,
mode 0600) and exits 0. `roam pipe --name N HOST TARGET` run again, from any
address and also after a reboot, re-attaches: what the target sent meanwhile
is printed, what the old stdin gave is sent, each byte once. Re-attach
within the relay's suspend timeout. `roam status` lists detached sessions.
While attached, a named session also keeps a journal there: a copy of its
state written before each byte that would make the last copy stale leaves.
So a client killed outright (kill -9, a crash, a power-off of the laptop
once the page cache reached the disk) leaves it re-attachable too:
`roam status` lists it as left by a killed client, with how many bytes of
input the session had taken and of output had been printed, and the next
`roam pipe --name` says the same. Bytes the killed process had read from its
stdin but not yet handed to the session are gone with it: feed the new
process its stdin from that byte on (e.g. `tail -c +$((N+1)) file`). Output
goes on exactly after the last byte the killed process printed, except that
a kill falling between a write to stdout and its 8-byte mark repeats that
write (at most 4 KiB). The journal costs throughput: on loopback a named
pipe moves about half of an unnamed one's MB/s uploading and 0.4 of it
downloading. A named session needs a relay: it never falls back to direct
TCP.

Exit status: 0 done (or detached); 1 an error (message on stderr); 2 bad
arguments or configuration; 3 the session was lost (the relay restarted
without it, expired it or refused it); 128+N ended by signal N.")]
    Pipe(PipeArgs),
    /// Forward a local port through the relay: each local connection is a stream of one session.
    #[command(after_help = "\
Examples:
  roam forward relay.example 127.0.0.1:5433 127.0.0.1:5432
  psql -h 127.0.0.1 -p 5433                     # reaches 127.0.0.1:5432 on the relay host

On SIGHUP, SIGINT or SIGTERM roam closes the session (waiting at most 3 s for
the relay) and exits 128+signal. If the relay loses the session (it restarted,
or reclaimed a session left without connections), the next local connection
opens a new session.

With --name N the session outlives the process, as a named `roam pipe`'s
does: those signals and `roam detach N` detach it (saved to the state
directory, exit 0), a journal keeps it re-attachable if the process is
killed outright, and the same command run again re-attaches it, from any
address, within the relay's suspend timeout (`roam status` lists it
meanwhile). The local connections cannot outlive the process that accepted
them: their streams are reset when the session is re-attached (the relay
then closes their target connections, code 0x105), and every new local
connection is a new stream of the same session. If the relay lost the
session, the re-attach says so and starts a new one.")]
    Forward(ForwardArgs),
    /// Run a program whose TCP connections, outgoing and incoming, are roam sessions wherever the other host runs roam.
    #[command(after_help = "\
Examples:
  roam run -- curl -O http://files.example/big.iso
  roam run --port 5432 -- psql -h db.example
  roam run -- python3 -m http.server 8000      # a server: its host becomes enhanced

The program runs unchanged, with roam's preload library in LD_PRELOAD (no
root needed).

Outgoing: each TCP connect to a non-loopback IPv4 or global IPv6 address
(on the --port ports, default all) is bound to loopback and handed to roam's
agent in this
process, which asks the destination host once whether it runs roam on the
relay port (--relay-port, default 7447: `roam serve`, or a server under
`roam run`):

- yes: the connection is a stream of one roam session to that host (its key
  pinned on first use, as `roam pipe` does). A link cut, a new address at
  this end, a reset by the network or a suspension of this machine pass
  unnoticed by the program. A `roam serve` relay must allow the destination
  (e.g. `roam serve --allow '*:80'`); it connects from its own host.
- no: the agent connects to the destination itself: the bytes are exactly
  the program's.

Incoming: when the program listens on a non-loopback address (or on `::`
or 0.0.0.0), on the --port ports, this process takes roam sessions on the
relay port for this host (with the state directory's server key, any client
key) and connects each of their streams from loopback to the program's
listener for that port; other ports are refused. accept() returns such a
connection with the roam client's address, so the program logs and checks
the real client. Ordinary clients connect to the program directly, as
before. If the relay port is taken (a `roam serve` runs here), that relay
serves this host, and the program sees its connections as coming from it.

The program keeps ordinary descriptors (epoll, poll, select, fork, exec and
dup work as before; children inherit the library). getpeername() on a
carried socket names the real peer, not the agent; on an incoming one,
where the client is now (it may have moved). IPv4 and IPv6 both ways.
Not carried: link-local IPv6 addresses, UDP, statically linked programs
(they ignore LD_PRELOAD).

roam run ends when the program does (after delivering what it wrote). A
program that leaves processes running and exits (a daemon such as nginx, or
`sh -c 'server &'`) is said so: roam run goes on carrying their connections
(and its relay) until the last of them ends, passing signals on to them,
and then exits with the program's own status. (They are found by the
environment roam run gave the program; one that clears its environment
before exec is not.)

Exit status: the program's (128+signal if a signal ended it). SIGINT, SIGTERM
and SIGHUP are passed to the program.")]
    Run(RunArgs),
    /// Make this host's connections to chosen ports roam sessions wherever the peer runs a relay (root, nftables).
    #[command(after_help = "\
Examples:
  roam intercept --port 5432 --port 6379        # until Ctrl-C
  psql -h db.example                             # an ordinary program, unchanged
  roam intercept --port 5432 --incoming          # on db.example: the server side
  roam intercept --cleanup                       # remove rules a crash left

Nothing in the programs changes. An nftables rule set (table inet
roam_intercept_<pid>) redirects this host's new outgoing TCP connections to
the ports to roam's agent on 127.0.0.1. For each one the agent asks the
destination host, once, whether it runs roam on the relay port
(--relay-port, default 7447: `roam serve`, `roam intercept --incoming` or a
server under `roam run`):

- yes: the connection becomes a stream of one roam session to that host,
  shared by all connections to it, pinned to the relay's key on first use
  as `roam pipe` does. It survives link loss, resets by the network, a new
  address at the server's end and suspension; the program never sees them
  (a new address at this end ends the program's socket, bound to the old
  one: `roam run` binds it to loopback instead). A `roam serve` relay must
  allow the destination (e.g. `roam serve --allow '*:5432'`) and connects
  from its own host, so the server sees the relay's address; with
  `roam intercept --incoming` there, the server sees this host's.
- no (refused, or silent for --probe-timeout): the connection goes straight
  to the destination, byte for byte what it would have been, and the host
  is asked again after --recheck.

--incoming makes this host the server side too: the agent takes roam
sessions on the relay port (all addresses; the state directory's server
key, any client key) and connects each stream, for one of the --port ports
on one of this host's addresses, to that local server with the client's own
address and port as its source (IP_TRANSPARENT; an nftables route chain
and a policy route, `ip rule fwmark 0x726f616e lookup 29295`, bring the
server's answers back to the agent). The server sees and logs the real
client, as with plain TCP (IPv4 clients; an IPv6 client's stream comes
from this host's own address). Ordinary clients still connect directly. Needs
rp_filter off or loose (2), as Debian sets it, not strict.

Loopback, this host's own addresses and roam's own sockets are never
redirected. IPv4 and IPv6 (to the agent on [::1]); UDP is not carried. The rules are removed when roam
intercept exits (SIGINT, SIGTERM, SIGHUP); after a crash, the next roam
intercept or `roam intercept --cleanup` removes them.

Exit status: 128+signal after a signal; 1 an error (e.g. not root, no nft).")]
    Intercept(InterceptArgs),
    /// A persistent interactive shell on HOST: it keeps running, with its screen, when you detach or lose the client.
    #[command(after_help = "\
Examples:
  roam shell server.example                # a new shell; its name is shown
  roam shell alice@server.example --name work
  roam shell server.example --name work    # later, anywhere: the same shell

The relay must run with --shell, and your client key must be in the
account's roam authorized keys there (~USER/.config/roam/authorized_keys by
default). The shell runs on a pty on the relay's host, as that user. Type ~.
at the start of a line to detach (the shell keeps running; ~~ sends a ~).
Closing the terminal, SIGHUP or SIGTERM detach too, and so does losing the
client altogether (kill -9, a crash, a reboot): re-attach by name from a new
process, anywhere, and get the scrollback and the current screen. Window
size changes follow. USER defaults to the local user name.

Exit status: the shell's own when it exits; 0 detached; 1 an error (or the
relay refused the shell, the message says why); 3 the session was lost.")]
    Shell(ShellArgs),
    /// Internal: an attached shell's per-session process, started by `roam serve --shell`.
    #[command(hide = true)]
    ShellWorker(ShellWorkerArgs),
    /// Move a running process, with its TCP connections and its address, to another host.
    #[command(after_help = "\
Examples:
  roam migrate-process 4242 --to hostb.example          # its one address moves along
  roam migrate-process $(pidof redis-server) --to 10.0.0.2:7448 --address 10.0.0.50/24
  roam migrate-process $(pidof java) --to hostb --lazy-pages   # 8 GB heap: post-copy
  roam migrate-process $(pidof roam) --to hostb --address 10.0.0.5 \\
      --sessions-to 10.0.1.7:7447 --server-key /var/lib/roam/server.key   # a relay, new address

The destination runs `roam migrate-accept` (as root, with CRIU) and lists this
host's client key (`roam keygen` prints it) in its authorized keys. Both hosts
are on one link (the address moves between them, as in a cluster with one
service address per process); peers notice a pause, not a reset.

What happens: the destination is asked first whether it can host the address
(nothing is frozen before it agrees). Then the address is locked here (its TCP
packets dropped; peers retransmit), CRIU freezes and dumps the process with its
established connections, listening and UDP sockets, and the images travel over
an encrypted roam session (no shared filesystem). The destination locks the
address, adds it to its interface, restores the process, and only then is the
process here let go: CRIU ends it without a packet, the address comes off this
host, and the destination lifts its lock and announces the address (gratuitous
ARP; for IPv6 an unsolicited Neighbor Advertisement). Phases and bytes are shown as they happen; a summary gives the freeze
(first lock to the destination's go), each phase's share and the image bytes.

If anything fails before the destination has the process — it refuses, its disk
fills, it dies, the session breaks, Ctrl-C — the dump is rolled back: the
process runs on here with its connections and address untouched, and the error
says why. The address defaults to the one address the process's sockets are
bound to; name it with --address when they use none (wildcards) or several.

TCP packets that reach this host for the address during the freeze are
captured (they are dropped here, before the process could see them) and
delivered at the destination once the process runs there, so that peers do not
wait for their retransmission timers; --no-reinject leaves them to TCP.

By default the process's memory travels inside the freeze, which therefore grows
with memory size. --lazy-pages (post-copy) leaves it out: the process runs at
the destination once the rest is there, and its pages follow over the session
(each one on first touch, the rest in the background) while it runs; the
summary says how much memory followed and how long it took. The pages come
from the frozen process here, read by roam; the CRIU scripts/criu-build makes
leaves them where they are during the dump. A stock CRIU captures them into
pipes inside the freeze: for it, without CAP_SYS_RESOURCE, fs.pipe-max-size
is raised to 4 MiB from the dump until the move ends (and put back, by a
watcher if roam is killed). A destination that
shares this host's pid space (namespaces on one machine) must run
`roam migrate-accept` in a pid namespace of its own (`unshare --pid --fork
--mount-proc`): the process keeps its pid here until its last page is sent.

A destination with another address (what CRIU cannot do for TCP): when the
process's clients are roam clients (a `roam serve` relay, with the servers it
reaches over loopback as its children; any server built on roam), give
--sessions-to B_ADDRESS:PORT and its --server-key. The address stays here and
is locked in the freeze; the sessions' connections are cut (they could not be
rebuilt at another address), the rest moves as above, and this command then
answers the clients' resumes here with the session protocol's `Moved` naming
B for --redirect-for seconds: they resume there, every byte intact. The
process must listen on a wildcard address (0.0.0.0 or ::).

Exit status: 0 moved; 1 not moved (the process runs on here) or moved with a
warning (printed); 2 bad arguments.")]
    MigrateProcess(MigrateProcessArgs),
    /// Accept processes moved here by `roam migrate-process` (run as root, with CRIU).
    #[command(after_help = "\
Examples:
  roam migrate-accept --authorized-keys /etc/roam/migrate_keys
  roam migrate-accept --listen 10.0.0.2:7448 --authorized-keys keys --dev eth1

Listens for roam sessions (port 7448 by default) from the client keys in
--authorized-keys only: accepting a process means running it here as its own
user. Each migration's images are written to a private directory under
--images-dir (default: the temporary directory) and removed once the process
runs; the address is added to the interface on its subnet (or --dev). A
migration that fails here is undone (address, lock, restored copy) and the
source is told why; CRIU's log of a failed restore is kept and named. One
migration runs at a time. Stops on SIGINT or SIGTERM.")]
    MigrateAccept(MigrateAcceptArgs),
    /// Store a suspended environment's images (disk, memory, any file) as its next version in an encrypted store.
    #[command(after_help = "\
Examples:
  roam suspend --env laptop disk.qcow2 memory.img        # version 1 in <state dir>/store
  roam suspend --env laptop disk.qcow2 memory.img        # version 2: changed chunks only
  roam suspend --env laptop --store /media/usb/roam disk.img
  AWS_ACCESS_KEY_ID=.. AWS_SECRET_ACCESS_KEY=.. \\
    roam suspend --env laptop --store s3://my-bucket --s3-endpoint https://s3.example disk.img
  roam suspend --env laptop --store roam://store.example:7449 disk.img   # a `roam store serve`

  # a running QEMU VM (started with -qmp unix:/vm/qmp.sock,server=on,wait=off):
  roam suspend --env lab --vm /vm/qmp.sock /vm/disk.img  # stop, store memory + disk, quit

With --vm QMP_SOCKET, roam stops the VM, has QEMU write its memory and device
state (QEMU's migration stream) to a file beside the first FILE, and stores
that as image vm-memory with the disk FILEs in one version; the VM quits once
the version is written. If anything fails the VM is continued where it was.
Resume it anywhere with `roam resume --vm` (see its --help).

Lazy memory: if the VM's RAM is a shared file (-object memory-backend-file,
id=mem,size=128M,mem-path=FILE,share=on -machine memory-backend=mem), roam
finds it over QMP and stores FILE as image vm-ram (chunked like a disk, so
a second suspend uploads only changed chunks) and the device state alone
(migration with x-ignore-shared) as image vm-devstate, instead of vm-memory.
`roam resume --vm --demand-fetch` can then start the guest before its RAM is in.

Each FILE becomes an image named by its base name (two files with one base
name are refused). The images are cut into 128 KiB chunks; each chunk is
compressed, encrypted and named with keys derived from its content and your
store secret (convergent encryption, as in Internet Suspend/Resume), and only
chunks the store lacks are uploaded: a second suspend of a disk with a few
changed blocks uploads those chunks only (chunks of the previous version are
skipped without asking the store). The version's manifest, encrypted too, is
written last: a version exists whole or not at all. Progress goes to stderr,
a summary (chunks uploaded and already stored, bytes, MB/s) to stdout.

STORE is a directory (default <state dir>/store) or s3://BUCKET on any
S3-compatible service: --s3-endpoint URL (default $ROAM_S3_ENDPOINT), region
$ROAM_S3_REGION (default us-east-1), credentials $AWS_ACCESS_KEY_ID and
$AWS_SECRET_ACCESS_KEY. The config file's [store] section can set the store,
endpoint, region and secret. STORE may also be roam://HOST:PORT, a `roam store
serve` reached through an authenticated roam session: a network drop pauses
the transfer instead of failing it (up to --store-timeout, default 60 s).

The store secret (32 bytes, <state dir>/store.secret, or --secret FILE) is
created with mode 0600 by the first suspend. It encrypts and names everything
you store: keep a copy somewhere safe; without it the data cannot be read.

Exit status: 0 stored; 1 an error (message on stderr; no version was
written); 2 bad arguments or configuration.")]
    Suspend(SuspendArgs),
    /// Write every image of a stored environment version into a directory, each chunk verified.
    #[command(after_help = "\
Examples:
  roam resume --env laptop ./vm                  # the newest version
  roam resume --env laptop --version 1 ./vm-old
  roam resume --env laptop --force ./vm          # overwrite images already there
  roam resume --env laptop --store s3://my-bucket --s3-endpoint https://s3.example ./vm
  roam resume --env laptop --store roam://store.example:7449 ./vm   # survives network drops

  # a VM suspended with `roam suspend --vm`: write its images into /vm, then
  # start QEMU on them; the guest runs on from where it was stopped
  roam resume --env lab --force --vm /vm -- qemu-system-x86_64 -m 128 \
    -kernel vmlinuz -initrd initrd.gz -drive file=/vm/disk.img,format=raw,if=virtio \
    -qmp unix:/vm/qmp.sock,server=on,wait=off

With --vm, the QEMU command after `--` must configure the same machine as the
one suspended (memory size, devices, kernel), with its disks at their paths
in DIR; roam adds -incoming (loading DIR/vm-memory) and a QMP socket of its
own, starts the guest once the memory is loaded, then waits for QEMU and exits
with its status (SIGINT and SIGTERM go to QEMU). A -qmp socket of your own
lets you `roam suspend --vm` it again later.

Demand fetch (--vm --demand-fetch): only the memory image is written before
QEMU starts. Each image the QEMU command opens as `-drive file=DIR/<image>`
is served to QEMU over NBD from a Unix socket in DIR instead (roam rewrites
that `file=` to `file.driver=nbd,file.server.type=unix,file.server.path=
SOCK,file.export=<image>` and keeps the drive's other suboptions): a chunk
is fetched, verified and cached in DIR the first time the guest reads it,
and once the guest runs the remaining chunks are fetched in order in the
background (eight at once, one while the guest is fetching: its reads come
first). When QEMU exits, roam finishes that fill (progress on stderr)
and renames the cache file to DIR/<image>, an ordinary complete image, as
copy-in would have left it plus the guest's writes. It pays when the disk is
large and the link slow: the guest starts after its memory image instead of
after every disk chunk. A chunk that fails verification is an I/O error for
the guest (and a line on stderr), never wrong data. `roam suspend --vm` of
such a VM needs the fill done (DIR/<image> appears when it is):

  roam resume --env lab --force --vm --demand-fetch /vm -- qemu-system-x86_64 ...

A version with lazy memory (vm-ram and vm-devstate, see `roam suspend
--help`) needs the QEMU command to map DIR/vm-ram with share=on (-object
memory-backend-file,id=mem,size=SIZE,mem-path=DIR/vm-ram,share=on -machine
memory-backend=mem). With --demand-fetch only vm-devstate is written first:
roam mounts a FUSE file system in DIR (root or fusermount3 needed) whose one
file is the RAM, points mem-path at it, and fetches a chunk (verified) when
the guest first touches it; the background fill of the rest waits until the
guest has not faulted for 1.5 s. The mount is undone when QEMU exits.

Trickle write-back (--demand-fetch --trickle RATE, e.g. 4M for 4 Mbit/s):
while the guest runs, each disk chunk it wrote and then left alone for 1 s
is uploaded in the background, sealed as a suspend seals it, at most RATE
bits per second of objects; a chunk written again goes again. The next
`roam suspend --vm` then finds those chunks stored and uploads only the
rest (its summary says how many were written back). Until that suspend's
version names them, a lease in the store (leases/ENV/...) keeps `roam store
gc` from deleting them; roam deletes it when QEMU exits. Progress lines
(`roam: trickle: N chunks written back ..., P pending`) go to stderr.

DIR is created if missing. Each image is written to a temporary file in DIR
(mode 0600) and renamed to its name once complete, so a failure (a missing
or corrupt chunk, a full disk, Ctrl-C) never leaves a partial file under an
image's name. Every chunk is checked (its authentication tag, then its
SHA-256 against the manifest) before a byte of it is written. Existing files
of an image's name are refused unless --force. Needs the store secret the
environment was suspended with (see `roam suspend --help`).

Lookaside (--lookaside DIR, repeatable): before fetching a chunk, roam looks
for it in the files under DIR (walked without following symbolic links; a
file may be named instead), cut at the store's 128 KiB chunk boundaries and
indexed by SHA-256 when the resume starts. An older resumed copy of the same
environment, a copy on a USB disk or a read-only medium all serve: a chunk
found there is read again and used only if its length and SHA-256 match the
version's manifest; anything else (stale, altered, unreadable) is fetched
from the store. A lookaside DIR that does not exist is a warning, not an
error. The summary says how many chunks and bytes came from lookaside and how
many were fetched:

  roam resume --env laptop --lookaside ./vm-old --lookaside /media/usb/vm ./vm
  roam resume --env laptop --force --lookaside ./vm ./vm   # refresh in place

Exit status: 0 written (with --vm: QEMU's own status); 1 an error (message
on stderr); 2 bad arguments.")]
    Resume(ResumeArgs),
    /// Fetch the newest (or a named) version of an environment into a hoard at this site ahead of a resume, each chunk verified.
    #[command(after_help = "\
Examples:
  roam hoard --env laptop /var/cache/roam-hoard/laptop          # once
  roam hoard --env laptop --follow --interval 1m /var/cache/roam-hoard/laptop
  roam hoard --env laptop --store roam://store.example:7449 /var/cache/roam-hoard/laptop
  roam hoard --env laptop --version 3 /var/cache/roam-hoard/laptop   # an older one

  # later, when the user arrives: only what the hoard lacks is fetched
  roam resume --env laptop --lookaside /var/cache/roam-hoard/laptop ./vm

Hoarding is Internet Suspend/Resume's fully proactive policy: the resume site
fetches the environment before the user arrives, so the resume itself moves
little. DIR gets the newest version's images (or --version N's) under
DIR/images/ and a file
DIR/HOARD saying which environment and version they are; it is a cache, not
an environment to run (`roam resume` refuses to write into it). Give it to
`roam resume --lookaside DIR`: every chunk found there is read again and used
only if its SHA-256 matches the version being resumed, so a hoard that is
older than the newest version, or altered, still gives the right bytes; the
rest comes from the store.

Each hoard is incremental: the chunks already in DIR (of any older version)
are taken from there after the same check, only the others are fetched from
the store, each verified (authentication tag, then SHA-256 against the
version's manifest) as `roam resume` does. A hoard of a version DIR already
holds fetches nothing and repairs any chunk that no longer matches. The new
images are written beside the old ones and put in place when all are
complete; a failure or a signal leaves the previous hoard as it was. Progress
goes to stderr, one summary line per version hoarded to stdout (chunks and
bytes fetched, chunks and bytes already there).

--follow keeps DIR current: after the first hoard, roam asks the store for a
newer version every --interval (default 30s, at least 100ms) and hoards each
one as it appears. A failed check or hoard is reported and tried again at the
next interval (the first one is fatal: unknown environment, wrong secret).
SIGINT or SIGTERM stops it cleanly: a hoard under way is abandoned and its
partial files removed; exit status 0.

DIR is created (mode 0700) if missing; a directory that holds other files and
no DIR/HOARD is refused, as is a hoard of another environment. One roam
process hoards into a DIR at a time. The store and secret are given as for
`roam resume`; the secret must be at this site (the hoard is plaintext at
rest, as a resumed copy is: keep DIR on a disk only you can read).

Exit status: 0 hoarded (or, with --follow, stopped by a signal); 1 an error
(message on stderr); 2 bad arguments.")]
    Hoard(HoardArgs),
    /// List or garbage-collect the environments in a store.
    #[command(after_help = "\
Examples:
  roam store list                          # every environment, version, image
  roam store list --env laptop
  roam store gc --env laptop --keep 2      # drop older versions and their chunks

Exit status: 0 done; 1 an error (message on stderr); 2 bad arguments.")]
    Store(StoreArgs),
    /// Detach a named session from the `roam pipe --name` or `roam forward --name` process attached to it.
    #[command(after_help = "\
Examples:
  roam detach backup      # the attached process saves the session and exits 0
  roam pipe --name backup relay.example 9000 < rest.tar   # re-attach later

The process saves the session's client state to the state directory and
exits; the relay keeps the session suspended until a client re-attaches or
its suspend timeout passes. Waits (up to 10 s) until the record is written.
Works for `roam forward --name` too (re-attach with the same forward command).")]
    Detach(DetachArgs),
    /// List this user's live sessions (from running pipe, forward and serve processes).
    #[command(after_help = "\
Examples:
  roam status
  roam status --json | jq '.processes[].sessions[].state'
  roam status --json | jq '.detached[].name'

Detached named sessions (`roam pipe --name`) are listed after the processes.")]
    Status(StatusArgs),
    /// Operate a cluster of roam-continuation hosts: list, move and drain sessions.
    #[command(after_help = "\
Examples:
  roam cluster --cluster-file /etc/files/cluster.conf --key ~/.config/roam/operator.key status
  roam cluster -c cluster.conf -k op.key status --json | jq '.[] | {host, sessions: (.sessions|length)}'
  roam cluster -c cluster.conf -k op.key move 7a744b7a479cf23dc098e3759aea425a --to b
  roam cluster -c cluster.conf -k op.key drain a      # before stopping host a

The cluster file is the one the hosts run with (`cluster NAME`, then
`host NAME clients=ADDR peers=ADDR key=HEX` lines); your key must be listed
in it as `operator NAME key=HEX` (make one with `roam keygen --out op.key`).
Requests go to each host's `peers` address over Noise, authenticated both
ways with the keys in the file. A move or drain waits until the sessions are
on their new hosts and prints what moved and what failed (failed sessions
stay where they were and keep working).")]
    Cluster(ClusterArgs),
    /// Generate a static key pair; prints the public key.
    #[command(after_help = "\
Examples:
  roam keygen                         # writes <state dir>/client.key
  roam keygen --out /etc/roam/server.key
  roam serve --key /etc/roam/server.key")]
    Keygen(KeygenArgs),
    /// Self-contained demonstration: a session survives its connection being killed.
    #[command(after_help = "\
Examples:
  roam demo
  cargo run --release -p roam-cli -- demo

Starts a relay and an echo target on loopback, streams data through a client
session, cuts the link mid-transfer, and shows the session suspend, resume and
deliver every byte exactly once (checked with SHA-256). Touches nothing outside
127.0.0.1 and writes no files.")]
    Demo(DemoArgs),
}

#[derive(Debug, Args)]
pub(crate) struct ServeArgs {
    /// Address to listen on [default: 0.0.0.0:7447].
    #[arg(long, value_name = "ADDR")]
    pub(crate) listen: Option<String>,
    /// Allowed target `host:port` (repeatable; `*` wildcards). Default: 127.0.0.1:22 only.
    #[arg(long = "allow", value_name = "HOST:PORT")]
    pub(crate) allow: Vec<String>,
    /// Server key file [default: <state dir>/server.key, created with mode 0600].
    #[arg(long, value_name = "FILE")]
    pub(crate) key: Option<PathBuf>,
    /// Only accept clients whose public key is listed (one hex key per line).
    #[arg(long, value_name = "FILE")]
    pub(crate) authorized_keys: Option<PathBuf>,
    /// Keep a suspended session this long (e.g. 3d, 12h, 30m, 90s) [default: 3d].
    #[arg(long, value_name = "DURATION")]
    pub(crate) suspend_timeout: Option<String>,
    /// Keep a suspended session with no open stream only this long [default: 60s].
    /// Such a session holds nothing its client could lose (a `roam forward`
    /// whose empty session was reclaimed opens a fresh one), so reclaiming it
    /// early stops vanished clients and handshake floods from filling the
    /// session table for the whole --suspend-timeout.
    #[arg(long, value_name = "DURATION", verbatim_doc_comment)]
    pub(crate) idle_suspend_timeout: Option<String>,
    /// Park a session once it has been suspended this long [default: 10s]:
    /// it becomes its continuation (a few hundred bytes plus its unacknowledged
    /// and unread bytes) with its target connections, and its tasks and
    /// buffers are freed. The client's resume restores it (a fraction of a
    /// millisecond more). 0s parks at once.
    #[arg(long, value_name = "DURATION", verbatim_doc_comment)]
    pub(crate) park_after: Option<String>,
    /// Client connections handled at once [default: 1024, less if the open-file
    /// limit is low]. Further ones are answered "busy" at once.
    #[arg(long, value_name = "N", verbatim_doc_comment)]
    pub(crate) max_connections: Option<usize>,
    /// Sessions held at once, suspended ones included [default: 4096].
    #[arg(long, value_name = "N")]
    pub(crate) max_sessions: Option<usize>,
    /// Sessions one client IP address may hold [default: 128].
    #[arg(long, value_name = "N")]
    pub(crate) max_sessions_per_ip: Option<usize>,
    /// Sessions one client key may hold [default: 128].
    #[arg(long, value_name = "N")]
    pub(crate) max_sessions_per_key: Option<usize>,
    /// Target connections held at once by all sessions [default: derived from
    /// the open-file limit so the relay never runs out of descriptors, at most
    /// 8192]. Streams beyond it are reset with code 0x104.
    #[arg(long, value_name = "N", verbatim_doc_comment)]
    pub(crate) max_targets: Option<usize>,
    /// Target connections one session may hold [default: 256]. Streams beyond
    /// it are reset with code 0x104.
    #[arg(long, value_name = "N", verbatim_doc_comment)]
    pub(crate) max_targets_per_session: Option<usize>,
    /// Serve Prometheus metrics at http://ADDR/metrics (OpenMetrics text):
    /// sessions by state, opened and closed (by how), bytes, resumes, bytes
    /// replayed, streams, target connections, refused streams, connections
    /// and sessions by reason, each cap with its use, shells attached and
    /// parked, and sessions moved by takeovers (out, in with their client
    /// connection or by resume) with how long each was stopped. Plain HTTP
    /// without authentication, as with any exporter: use a loopback or
    /// private address, e.g. 127.0.0.1:9447.
    #[arg(long, value_name = "ADDR", verbatim_doc_comment)]
    pub(crate) metrics: Option<String>,
    /// Serve `roam shell`: interactive shells on ptys, as the account each
    /// client names, for keys in that account's --shell-keys file. Shells
    /// keep running (with screen and scrollback) while clients are away.
    /// An attached shell's terminal runs in a process of its own (`roam
    /// shell-worker`, a child of the relay, listed by `roam status`), as
    /// the account (so a root relay's binary must be executable by every
    /// account that gets a shell, e.g. in /usr/local/bin); it ends when
    /// the client goes. Killed or crashed, it is replaced at once
    /// and loses no output (the relay keeps its journal), only keys typed
    /// that had not reached the shell yet.
    #[arg(long, verbatim_doc_comment)]
    pub(crate) shell: bool,
    /// Where an account's authorized keys for shells are: %h is its home
    /// directory, %u its name [default: %h/.config/roam/authorized_keys].
    /// The file, and every directory on its way up to /, must be owned by
    /// the account or root and writable by nobody else (as sshd's
    /// StrictModes; above the home a sticky directory such as /tmp passes).
    #[arg(long, value_name = "PATTERN", requires = "shell", verbatim_doc_comment)]
    pub(crate) shell_keys: Option<String>,
    /// Run this program (as a login shell, with -l) for every shell instead
    /// of each account's login shell, e.g. /bin/sh.
    #[arg(long, value_name = "PATH", requires = "shell", verbatim_doc_comment)]
    pub(crate) shell_program: Option<PathBuf>,
    /// Take over from the relay running with the same --takeover-socket: it
    /// hands this process its listening socket, every session and every
    /// target connection, then exits (see "Upgrades" below).
    #[arg(long, verbatim_doc_comment)]
    pub(crate) takeover: bool,
    /// The Unix socket a running relay hands over on
    /// [default: <state dir>/serve.takeover].
    #[arg(long, value_name = "PATH", verbatim_doc_comment)]
    pub(crate) takeover_socket: Option<PathBuf>,
    /// The state format this process claims in a takeover (tests of the
    /// refusal only).
    #[arg(long, value_name = "N", hide = true)]
    pub(crate) takeover_format: Option<u32>,
}

#[derive(Debug, Args)]
pub(crate) struct ClientArgs {
    /// Client key file [default: <state dir>/client.key, created with mode 0600].
    #[arg(long, value_name = "FILE")]
    pub(crate) key: Option<PathBuf>,
}

#[derive(Debug, Args)]
pub(crate) struct PipeArgs {
    /// Relay host, with optional port (default 7447): `host`, `host:port`, `[v6]:port`.
    #[arg(value_name = "HOST[:PORT]")]
    pub(crate) relay: String,
    /// `PORT` (127.0.0.1:PORT on the relay) or `HOST:PORT`.
    #[arg(value_name = "TARGET")]
    pub(crate) target: String,
    /// Never fall back to a direct TCP connection (same as `--fallback never`).
    #[arg(long, conflicts_with = "fallback")]
    pub(crate) no_fallback: bool,
    /// When to fall back to a direct, unprotected TCP connection if HOST runs
    /// no relay: `auto` (only for relays never pinned), `always`, `never`.
    #[arg(long, value_enum, value_name = "WHEN")]
    pub(crate) fallback: Option<Fallback>,
    /// Name the session, so that it outlives this process: a signal detaches
    /// it (saved to the state directory) instead of closing it, and the same
    /// command with the same name re-attaches.
    #[arg(long, value_name = "NAME")]
    pub(crate) name: Option<String>,
    #[command(flatten)]
    pub(crate) client: ClientArgs,
}

#[derive(Debug, Args)]
pub(crate) struct ShellArgs {
    /// The relay (`roam serve --shell`), with optional user and port: `host`, `alice@host:7447`.
    #[arg(value_name = "[USER@]HOST[:PORT]")]
    pub(crate) host: String,
    /// The shell's name: attach to it if it runs, else start it under that name.
    #[arg(long, value_name = "NAME")]
    pub(crate) name: Option<String>,
    #[command(flatten)]
    pub(crate) client: ClientArgs,
}

#[derive(Debug, Args)]
pub(crate) struct MigrateProcessArgs {
    /// The process to move (with its children).
    #[arg(value_name = "PID")]
    pub(crate) pid: i32,
    /// The destination's `roam migrate-accept`, with optional port (default 7448).
    #[arg(long, value_name = "HOST[:PORT]")]
    pub(crate) to: String,
    /// The address that moves with the process, `ADDR` or `ADDR/PREFIX`
    /// [default: the one address its sockets are bound to].
    #[arg(long, value_name = "ADDR")]
    pub(crate) address: Option<String>,
    /// Where the images are written before they travel [default: /dev/shm with --lazy-pages (its images hold no memory), else the temporary directory].
    #[arg(long, value_name = "DIR")]
    pub(crate) images_dir: Option<PathBuf>,
    /// Do not capture the packets that arrive during the freeze for
    /// re-injection at the destination (peers then retransmit them).
    #[arg(long)]
    pub(crate) no_reinject: bool,
    /// Post-copy: move the process's memory after the freeze instead of in
    /// it. The process runs at the destination as soon as everything but
    /// its memory is there, and each page follows over the same encrypted
    /// session when first touched (or in the background), so the freeze
    /// no longer grows with memory size. The price: from the restore on,
    /// the process needs both hosts until its last page has arrived — if
    /// the session breaks then, it stops (the destination kills its copy
    /// rather than let it read missing pages; the images here, memory
    /// included, are kept for a restore by hand). Up to that restore a
    /// failure leaves it running at the source, as without this flag.
    /// Needs CRIU's lazy pages (userfaultfd) at the destination.
    #[arg(long)]
    pub(crate) lazy_pages: bool,
    /// The process's connections are roam sessions (a roam relay, with the
    /// servers it reaches over loopback as its children, or any server
    /// built on roam): its address stays here, and its clients resume at
    /// HOST:PORT, the destination's own address and the port the process
    /// listens on (on a wildcard address). Their connections here are cut
    /// in the freeze; once the process runs there, this command answers
    /// their resumes here with the session protocol's `Moved` (for
    /// --redirect-for), and they follow, every byte intact. Needs
    /// --server-key.
    #[arg(long, value_name = "HOST:PORT", requires = "server_key")]
    pub(crate) sessions_to: Option<String>,
    /// The process's roam server key (e.g. the relay's `server.key`): the
    /// redirect here must prove it is the same server to its clients.
    #[arg(long, value_name = "FILE")]
    pub(crate) server_key: Option<PathBuf>,
    /// With --sessions-to: how long this host sends resuming clients on,
    /// in seconds (a client away longer finds nobody here).
    #[arg(long, value_name = "SECS", default_value_t = 600)]
    pub(crate) redirect_for: u64,
    /// How much CRIU logs here (dump.log in the images directory, kept
    /// when a move fails). CRIU writes its log while the process is
    /// frozen: `debug` lengthens the freeze (by about 30 ms at 1,000
    /// connections on the machine measured) and adds CRIU's phases to the
    /// summary's "in the dump" line.
    #[arg(long, value_name = "LEVEL", value_enum, default_value_t = CriuLog::Warnings)]
    pub(crate) criu_log: CriuLog,
    #[command(flatten)]
    pub(crate) client: ClientArgs,
}

/// How much CRIU logs during a move (`--criu-log`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum CriuLog {
    /// Errors only.
    Errors,
    /// Errors and warnings: enough to say why a move failed.
    Warnings,
    /// And CRIU's progress messages.
    Info,
    /// Everything: what a bug report needs.
    Debug,
}

impl From<CriuLog> for roam_criu::LogLevel {
    fn from(level: CriuLog) -> roam_criu::LogLevel {
        match level {
            CriuLog::Errors => roam_criu::LogLevel::Errors,
            CriuLog::Warnings => roam_criu::LogLevel::Warnings,
            CriuLog::Info => roam_criu::LogLevel::Info,
            CriuLog::Debug => roam_criu::LogLevel::Debug,
        }
    }
}

#[derive(Debug, Args)]
pub(crate) struct MigrateAcceptArgs {
    /// Address to listen on [default: 0.0.0.0:7448].
    #[arg(long, value_name = "ADDR:PORT")]
    pub(crate) listen: Option<String>,
    /// This host's key [default: <state dir>/server.key, created with mode 0600].
    #[arg(long, value_name = "FILE")]
    pub(crate) key: Option<PathBuf>,
    /// The client keys that may send a process here (one public key per line).
    #[arg(long, value_name = "FILE")]
    pub(crate) authorized_keys: PathBuf,
    /// Where received images are written [default: /dev/shm for a post-copy move (its images hold no memory), else the temporary directory].
    #[arg(long, value_name = "DIR")]
    pub(crate) images_dir: Option<PathBuf>,
    /// The interface moved-in addresses go on [default: the one on their subnet].
    #[arg(long, value_name = "IFACE")]
    pub(crate) dev: Option<String>,
    /// How much CRIU logs here (restore.log and lazy-pages.log in each
    /// move's images directory, kept when a move fails). The restore runs
    /// inside the source's freeze: `debug` lengthens it (by about 40 ms at
    /// 1,000 connections on the machine measured).
    #[arg(long, value_name = "LEVEL", value_enum, default_value_t = CriuLog::Warnings)]
    pub(crate) criu_log: CriuLog,
}

/// Where the store is and which secret opens it (`suspend`, `resume`, `store`).
#[derive(Debug, Args)]
pub(crate) struct StoreLocationArgs {
    /// The store: a directory, s3://BUCKET, or roam://HOST:PORT (a `roam store serve`, reached through an authenticated roam session that survives network drops) [default: <state dir>/store].
    #[arg(long, value_name = "STORE")]
    pub(crate) store: Option<String>,
    /// The S3 service's URL for an s3:// store [default: $ROAM_S3_ENDPOINT].
    #[arg(long, value_name = "URL")]
    pub(crate) s3_endpoint: Option<String>,
    /// The store secret (32 bytes) [default: <state dir>/store.secret].
    #[arg(long, value_name = "FILE")]
    pub(crate) secret: Option<PathBuf>,
    /// For a roam:// store: fail an operation the store server has not answered within this long, reconnecting included (a network drop shorter than this only pauses the transfer) [default: 60s].
    #[arg(long, value_name = "DURATION")]
    pub(crate) store_timeout: Option<String>,
}

#[derive(Debug, Args)]
pub(crate) struct SuspendArgs {
    /// The environment (1-128 characters of A-Z a-z 0-9 . _ -).
    #[arg(long, value_name = "NAME", value_parser = parse_env_name)]
    pub(crate) env: String,
    /// The images to store (named by their base names); with --vm, the VM's disk images.
    #[arg(value_name = "FILE", required = true)]
    pub(crate) files: Vec<PathBuf>,
    /// A running QEMU's QMP socket: stop the VM, store its memory (image vm-memory) with FILEs, then quit it.
    #[arg(long, value_name = "QMP_SOCKET")]
    pub(crate) vm: Option<PathBuf>,
    #[command(flatten)]
    pub(crate) location: StoreLocationArgs,
}

#[derive(Debug, Args)]
pub(crate) struct ResumeArgs {
    /// The environment.
    #[arg(long, value_name = "NAME", value_parser = parse_env_name)]
    pub(crate) env: String,
    /// The version to write [default: the newest].
    #[arg(long, value_name = "N")]
    pub(crate) version: Option<u64>,
    /// Overwrite files in DIR that have an image's name.
    #[arg(long)]
    pub(crate) force: bool,
    /// Where to write the images (created if missing).
    #[arg(value_name = "DIR")]
    pub(crate) dir: PathBuf,
    /// Take chunks from the files under DIR (or a file) before the store: an older resumed copy, a copy on portable media. Each is used only if it hashes to the manifest's entry. Repeatable.
    #[arg(long, value_name = "DIR")]
    pub(crate) lookaside: Vec<PathBuf>,
    /// Then start the QEMU command after `--` on the version's memory image (vm-memory) and let the guest run on.
    #[arg(long, requires = "qemu")]
    pub(crate) vm: bool,
    /// With --vm: start QEMU once the memory image is in and serve its `-drive file=DIR/<image>` disks over NBD, fetching each chunk when the guest first reads it and the rest in the background (pays for large disks over slow links).
    #[arg(long, requires = "vm")]
    pub(crate) demand_fetch: bool,
    /// With --demand-fetch: while the guest runs, write the disk chunks it changes back to the store in the background, at most RATE bits per second of (compressed, encrypted) chunk objects (`4M`, `500kbit`, `off`), so the next `roam suspend --vm` has little left to upload [default: off].
    #[arg(long, value_name = "RATE", requires = "demand_fetch", value_parser = crate::store::trickle::rate_arg)]
    pub(crate) trickle: Option<crate::store::trickle::Rate>,
    /// With --vm: the QEMU command line (the VM's configuration, as when it was suspended).
    #[arg(last = true, value_name = "QEMU_COMMAND", requires = "vm")]
    pub(crate) qemu: Vec<String>,
    #[command(flatten)]
    pub(crate) location: StoreLocationArgs,
}

#[derive(Debug, Args)]
pub(crate) struct HoardArgs {
    /// The environment.
    #[arg(long, value_name = "NAME", value_parser = parse_env_name)]
    pub(crate) env: String,
    /// The hoard directory at this site (created if missing; give it to `roam resume --lookaside`).
    #[arg(value_name = "DIR")]
    pub(crate) dir: PathBuf,
    /// The version to hoard (one the store holds, older or newer than DIR's) [default: the newest].
    #[arg(long, value_name = "N", conflicts_with = "follow")]
    pub(crate) version: Option<u64>,
    /// Keep hoarding: check the store for a newer version every --interval until SIGINT or SIGTERM.
    #[arg(long)]
    pub(crate) follow: bool,
    /// With --follow: how often to ask the store for a newer version (at least 100ms) [default: 30s].
    #[arg(long, value_name = "DURATION", requires = "follow")]
    pub(crate) interval: Option<String>,
    #[command(flatten)]
    pub(crate) location: StoreLocationArgs,
}

#[derive(Debug, Args)]
pub(crate) struct StoreArgs {
    #[command(subcommand)]
    pub(crate) action: StoreAction,
}

#[derive(Debug, Subcommand)]
pub(crate) enum StoreAction {
    /// The environments, their versions and their images' sizes.
    #[command(after_help = "\
Examples:
  roam store list
  roam store list --env laptop --store s3://my-bucket --s3-endpoint https://s3.example")]
    List {
        /// Only this environment.
        #[arg(long, value_name = "NAME", value_parser = parse_env_name)]
        env: Option<String>,
        #[command(flatten)]
        location: StoreLocationArgs,
    },
    /// Delete all but the newest N versions of an environment, then every chunk no remaining version uses.
    #[command(after_help = "\
Examples:
  roam store gc --env laptop --keep 1
  roam store gc --env old-vm --keep 0        # the whole environment

The chunks kept are those of every environment's remaining versions, so the
store's versions must all open with this secret (otherwise nothing is
deleted). Do not run it while a suspend to the same store is under way.")]
    Gc {
        /// The environment whose old versions go.
        #[arg(long, value_name = "NAME", value_parser = parse_env_name)]
        env: String,
        /// How many of its newest versions to keep.
        #[arg(long, value_name = "N")]
        keep: u64,
        #[command(flatten)]
        location: StoreLocationArgs,
    },
    /// Serve a store (a directory or an S3 bucket) to roam clients: `--store roam://HOST:PORT` then suspends and resumes through it.
    #[command(after_help = "\
Examples:
  # on the store host: clients must hold a key listed in clients.txt
  roam store serve --store /srv/roam-store --authorized-keys clients.txt
  roam store serve --listen 0.0.0.0:7449 --store s3://my-bucket --s3-endpoint https://s3.example \\
      --authorized-keys clients.txt

  # on a laptop (`roam keygen` prints the line for clients.txt)
  roam suspend --env laptop --store roam://store.example:7449 disk.img memory.img
  roam resume  --env laptop --store roam://store.example:7449 ./vm

Clients reach the server through an authenticated roam session: they pin the
server's key on first use (known_servers, as `roam pipe` does) and the server
admits only the client keys in --authorized-keys (or any, with --any-client).
Each operation is one stream of that session; when the network drops in the
middle of a suspend or resume, the session resumes once it is back and the
transfer carries on where it was (each client waits at most --store-timeout,
60 s by default, for an answer). The server only relays objects the clients
sealed: it never sees the store secret or a byte of plaintext. The frames are
specified in docs/STORE-REMOTE.md. Stop it with SIGINT or SIGTERM.")]
    Serve(StoreServeArgs),
}

/// `roam store serve`'s options.
#[derive(Debug, Args)]
#[command(group(clap::ArgGroup::new("clients").required(true).args(["authorized_keys", "any_client"])))]
pub(crate) struct StoreServeArgs {
    /// Where to listen for roam clients [default: 0.0.0.0:7449; `roam serve` has 7447, `roam migrate-accept` 7448].
    #[arg(long, value_name = "ADDR")]
    pub(crate) listen: Option<String>,
    /// The store the objects live in: a directory (made if missing) or s3://BUCKET [default: <state dir>/store].
    #[arg(long, value_name = "STORE")]
    pub(crate) store: Option<String>,
    /// The S3 service's URL for an s3:// store [default: $ROAM_S3_ENDPOINT].
    #[arg(long, value_name = "URL")]
    pub(crate) s3_endpoint: Option<String>,
    /// Server key file [default: <state dir>/server.key, created with mode 0600].
    #[arg(long, value_name = "FILE")]
    pub(crate) key: Option<PathBuf>,
    /// Only admit clients whose public key is listed (one hex key per line, as `roam keygen` prints).
    #[arg(long, value_name = "FILE")]
    pub(crate) authorized_keys: Option<PathBuf>,
    /// Admit any client key (anyone who reaches the port can read, write and delete the store's sealed objects).
    #[arg(long)]
    pub(crate) any_client: bool,
}

/// Checks an environment name (it becomes part of object names).
fn parse_env_name(name: &str) -> Result<String, String> {
    if roam_store::valid_env_name(name) {
        Ok(name.to_owned())
    } else {
        Err("use 1-128 characters of A-Z a-z 0-9 . _ - (not . or ..)".into())
    }
}

#[derive(Debug, Args)]
pub(crate) struct DetachArgs {
    /// The session's name (as given to `roam pipe --name`).
    #[arg(value_name = "NAME")]
    pub(crate) name: String,
}

/// When `roam pipe` may fall back to a direct TCP connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum Fallback {
    /// Only for a relay whose key was never pinned (the default).
    Auto,
    /// Even for a pinned relay.
    Always,
    /// Never.
    Never,
}

#[derive(Debug, Args)]
pub(crate) struct ForwardArgs {
    /// Relay host, with optional port (default 7447).
    #[arg(value_name = "HOST[:PORT]")]
    pub(crate) relay: String,
    /// Local address to listen on, e.g. 127.0.0.1:5433.
    #[arg(value_name = "LISTEN_ADDR:PORT")]
    pub(crate) listen: String,
    /// Target as seen from the relay, e.g. 127.0.0.1:5432.
    #[arg(value_name = "TARGET:PORT")]
    pub(crate) target: String,
    /// Name the session, so that it outlives this process: a signal detaches
    /// it (saved to the state directory) instead of closing it, and the same
    /// command with the same name re-attaches.
    #[arg(long, value_name = "NAME")]
    pub(crate) name: Option<String>,
    #[command(flatten)]
    pub(crate) client: ClientArgs,
}

/// How `roam run` and `roam intercept` find out whether a host runs a relay.
#[derive(Debug, Args)]
pub(crate) struct ProbeArgs {
    /// The relay port: where enhanced hosts take roam sessions (`roam serve`, or a server under `roam run`).
    #[arg(long, default_value_t = 7447, value_name = "PORT")]
    pub(crate) relay_port: u16,
    /// How long the relay port may stay silent before a host counts as ordinary.
    #[arg(long, default_value = "1s", value_name = "DURATION")]
    pub(crate) probe_timeout: String,
    /// How long a host stays ordinary before it is asked again.
    #[arg(long, default_value = "60s", value_name = "DURATION")]
    pub(crate) recheck: String,
}

#[derive(Debug, Args)]
pub(crate) struct RunArgs {
    /// TCP port to carry (repeatable): the destination port of an outgoing connection, the port of a listener [default: every port].
    #[arg(long = "port", value_name = "PORT")]
    pub(crate) ports: Vec<u16>,
    #[command(flatten)]
    pub(crate) probe: ProbeArgs,
    #[command(flatten)]
    pub(crate) client: ClientArgs,
    /// The program and its arguments (after `--`).
    #[arg(
        trailing_var_arg = true,
        allow_hyphen_values = true,
        required = true,
        value_name = "CMD"
    )]
    pub(crate) command: Vec<std::ffi::OsString>,
}

#[derive(Debug, Args)]
pub(crate) struct InterceptArgs {
    /// Destination TCP port whose connections to go through roam (repeatable).
    #[arg(long = "port", value_name = "PORT")]
    pub(crate) ports: Vec<u16>,
    #[command(flatten)]
    pub(crate) probe: ProbeArgs,
    /// Remove every rule set `roam intercept` installed on this host (e.g. after a crash), then exit.
    #[arg(long)]
    pub(crate) cleanup: bool,
    /// Also be the server side: take roam sessions on the relay port and hand their streams for the ports to the local servers with the client's own address.
    #[arg(long)]
    pub(crate) incoming: bool,
    #[command(flatten)]
    pub(crate) client: ClientArgs,
}

#[derive(Debug, Args)]
pub(crate) struct StatusArgs {
    /// Machine-readable output: `{"processes": [...], "detached": [...]}`.
    #[arg(long)]
    pub(crate) json: bool,
}

#[derive(Debug, Args)]
pub(crate) struct ClusterArgs {
    /// The cluster file the hosts run with.
    #[arg(short = 'c', long, value_name = "FILE")]
    pub(crate) cluster_file: PathBuf,
    /// Your operator key (private; its public half is an `operator` line of the file).
    #[arg(short = 'k', long, value_name = "FILE")]
    pub(crate) key: PathBuf,
    /// How long to wait for a host's answer (a drain of many sessions takes a while).
    #[arg(long, default_value = "60s", value_name = "DURATION")]
    pub(crate) timeout: String,
    #[command(subcommand)]
    pub(crate) action: ClusterAction,
}

#[derive(Debug, Subcommand)]
pub(crate) enum ClusterAction {
    /// Every host's sessions and their states.
    Status {
        /// Machine-readable output: a JSON array of hosts with their sessions.
        #[arg(long)]
        json: bool,
    },
    /// Move one session (live or suspended) to another host.
    Move {
        /// The session id (32 hex digits, as `status` shows it).
        session: String,
        /// The destination host's name in the cluster file.
        #[arg(long, value_name = "HOST")]
        to: String,
    },
    /// Move every session off a host, to the others.
    Drain {
        /// The host to empty.
        host: String,
    },
}

/// `roam shell-worker` (internal): the relay passes the pty and the
/// terminal on the control socket that is its stdin.
#[derive(Debug, Args)]
pub(crate) struct ShellWorkerArgs {
    /// `user/name` of the shell, for the log.
    #[arg(long)]
    pub(crate) shell: String,
}

#[derive(Debug, Args)]
pub(crate) struct KeygenArgs {
    /// Where to write the private key [default: <state dir>/client.key].
    #[arg(long, value_name = "FILE")]
    pub(crate) out: Option<PathBuf>,
    /// Overwrite an existing key file.
    #[arg(long)]
    pub(crate) force: bool,
}

#[derive(Debug, Args)]
pub(crate) struct DemoArgs {
    /// Bytes to stream each way (suffixes K, M accepted).
    #[arg(long, default_value = "16M", value_name = "SIZE")]
    pub(crate) size: String,
}

pub(crate) fn init_logging(cli: &Cli) {
    let default = match cli.verbose {
        0 => "warn",
        1 => "info,roam=info",
        _ => "debug",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
}

/// Runs the command; returns the process exit code.
pub(crate) fn run(cli: Cli) -> i32 {
    let config = match FileConfig::load(cli.config.as_deref()) {
        Ok(c) => c,
        Err(e) => {
            eprintln_whole!("roam: {e}");
            return 2;
        }
    };
    // The client commands run one session on one thread: its driver, the
    // application sockets and their copies hand off without crossing threads.
    // On a 2-core loopback `roam forward` measured (median of runs, 1-byte
    // ping-pong) 76 us vs 82 us and 127-149 vs 85-110 MiB/s echo throughput
    // against the multi-thread runtime. The relay serves many sessions and
    // keeps a worker per core.
    let mut builder = match cli.command {
        Command::Pipe(_) | Command::Forward(_) | Command::Shell(_) | Command::ShellWorker(_) => {
            tokio::runtime::Builder::new_current_thread()
        }
        _ => tokio::runtime::Builder::new_multi_thread(),
    };
    let rt = match builder.enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln_whole!("roam: cannot start the async runtime: {e}");
            return 1;
        }
    };
    let result = rt.block_on(async move {
        match cli.command {
            Command::Serve(a) => crate::serve::run(*a, &config).await,
            Command::Pipe(a) => crate::pipe::run(a, &config).await,
            Command::Forward(a) => crate::forward::run(a, &config).await,
            Command::Intercept(a) => crate::intercept::run(a, &config).await,
            Command::Run(a) => crate::run::run(a, &config).await,
            Command::Status(a) => crate::control::status(a, &config).await,
            Command::Detach(a) => crate::pipe::detach(a, &config).await,
            Command::Shell(a) => crate::shell::client::run(a, &config).await,
            Command::ShellWorker(a) => crate::shell::worker::run(a).await,
            Command::Cluster(a) => crate::cluster::run(a).await,
            Command::Keygen(a) => crate::keys::keygen(a, &config),
            Command::Demo(a) => crate::demo::run(a).await,
            Command::MigrateProcess(a) => crate::migrate::source::run(a, &config).await,
            Command::MigrateAccept(a) => crate::migrate::dest::run(a, &config).await,
            Command::Suspend(a) => crate::store::suspend(a, &config).await,
            Command::Resume(a) => crate::store::resume(a, &config).await,
            Command::Hoard(a) => crate::store::hoard::run(a, &config).await,
            Command::Store(a) => crate::store::run(a, &config).await,
        }
    });
    // stdin is read on a blocking thread that cannot be interrupted: do not wait for it.
    rt.shutdown_timeout(Duration::from_millis(200));
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln_whole!("roam: {}", e.0);
            1
        }
    }
}

/// Errors for the user: a message saying what happened and what to do.
pub(crate) type CliResult = Result<i32, CliError>;

/// A user-facing error message. (Not `Display` itself, so that anything
/// displayable converts into it with `?`.)
#[derive(Debug)]
pub(crate) struct CliError(pub(crate) String);

impl<E: std::fmt::Display> From<E> for CliError {
    fn from(e: E) -> Self {
        CliError(e.to_string())
    }
}
