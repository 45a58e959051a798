//! The disk tier of streamed experts: experts read straight from the checkpoint's files with
//! many reads in flight at once (O_DIRECT where the file system allows it, so the page cache
//! does not keep a second copy of what the host tier was not given room for) into the caller's
//! staging memory, page-locked on CUDA. Reads go by `pread`, not through the weights' map, so a
//! file truncated or replaced under a running process is an error naming it rather than a
//! SIGBUS or another model's bytes: each read is checked against the file as it was when the
//! model was loaded.

use std::cell::RefCell;
use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::Instant;

use kestrel_core::rng::Rng;
use rayon::prelude::*;

use crate::error::{ModelError, Result};
use crate::experts::CopyPart;
use crate::weights::{FileIdent, Weights};

/// Reads in flight at once: enough to keep an NVMe drive's queues busy, where one reader
/// reaches a fraction of its bandwidth.
const READERS: usize = 32;

/// Reads are cut into pieces of at most this many bytes, so one expert's large matrices are
/// read by several readers.
const PIECE: usize = 1 << 20;

/// Direct reads start, end and land at multiples of this (the largest logical block size of
/// common drives).
const ALIGN: usize = 4096;

/// One weight file opened for reading.
struct DiskFile {
    path: PathBuf,
    file: File,
    /// Opened with O_DIRECT (else buffered, where the file system refuses it).
    direct: bool,
    ident: FileIdent,
}

impl DiskFile {
    fn open(path: &Path, ident: FileIdent) -> Result<DiskFile> {
        let io = |error| ModelError::Io {
            path: path.to_path_buf(),
            error,
        };
        let (file, direct) = match OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECT)
            .open(path)
        {
            Ok(f) => (f, true),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => (File::open(path).map_err(io)?, false),
            Err(e) => return Err(io(e)),
        };
        let f = DiskFile {
            path: path.to_path_buf(),
            file,
            direct,
            ident,
        };
        f.check()?;
        Ok(f)
    }

    /// An error unless the file is still the one the model was loaded from, as it was.
    fn check(&self) -> Result<()> {
        let meta = self.file.metadata().map_err(|error| ModelError::Io {
            path: self.path.clone(),
            error,
        })?;
        let now = FileIdent::of(&meta);
        if now == self.ident {
            return Ok(());
        }
        let what = if (now.dev, now.ino) != (self.ident.dev, self.ident.ino) {
            "was replaced by another file".to_string()
        } else if now.len != self.ident.len {
            format!("is now {} bytes, not the {} it had", now.len, self.ident.len)
        } else {
            "was modified".to_string()
        };
        Err(changed(&self.path, &what))
    }
}

fn changed(path: &Path, what: &str) -> ModelError {
    ModelError::Weights {
        path: path.to_path_buf(),
        reason: format!(
            "{what} since the model was loaded; its experts cannot be read (load the model again)"
        ),
    }
}

/// One read: `len` bytes at `offset` of file `file`, to `dst` of the caller's buffer.
#[derive(Debug, Clone, Copy)]
struct Piece {
    file: usize,
    offset: u64,
    len: usize,
    dst: usize,
}

thread_local! {
    /// Each reader's aligned landing space for direct reads.
    static BOUNCE: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

/// What the reader did so far.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct DiskStats {
    /// Bytes of experts read.
    pub bytes: u64,
    /// Experts read.
    pub experts: u64,
    /// Seconds spent in reads (the host waits for them).
    pub seconds: f64,
}

/// Reads experts from the weight files of a model (see the module's notes).
pub struct ExpertReader {
    /// Opened on first use, by weight file.
    files: Vec<Option<DiskFile>>,
    paths: Vec<Option<(PathBuf, FileIdent)>>,
    /// The readers, started on the first read (a session whose layers are all packed from
    /// weights in memory never reads).
    pool: Option<rayon::ThreadPool>,
    pub stats: DiskStats,
}

/// The readers of `pool`, started now if they were not.
fn readers(pool: &mut Option<rayon::ThreadPool>) -> Result<&rayon::ThreadPool> {
    if pool.is_none() {
        let p = rayon::ThreadPoolBuilder::new()
            .num_threads(READERS)
            .thread_name(|i| format!("kestrel-read-{i}"))
            .build()
            .map_err(|e| ModelError::Config {
                key: "expert reader".into(),
                reason: format!("could not start its threads: {e}"),
            })?;
        *pool = Some(p);
    }
    Ok(pool.as_ref().expect("started above"))
}

impl ExpertReader {
    /// A reader of `w`'s files.
    pub fn new(w: &Weights) -> ExpertReader {
        let mut paths = Vec::new();
        while let Some(f) = w.file(paths.len()).map(|(p, id)| (p.to_path_buf(), id)) {
            paths.push(Some(f));
        }
        ExpertReader {
            files: paths.iter().map(|_| None).collect(),
            paths,
            pool: None,
            stats: DiskStats::default(),
        }
    }

    /// Whether reads bypass the page cache (every file opened so far took O_DIRECT).
    pub fn direct(&self) -> bool {
        self.files.iter().flatten().all(|f| f.direct)
    }

    fn open(&mut self, file: usize) -> Result<&DiskFile> {
        if self.files.get(file).is_none_or(Option::is_none) {
            let Some(Some((path, ident))) = self.paths.get(file) else {
                return Err(ModelError::Config {
                    key: "expert reader".into(),
                    reason: format!("no weight file {file}"),
                });
            };
            let f = DiskFile::open(path, *ident)?;
            self.files[file] = Some(f);
        }
        Ok(self.files[file].as_ref().expect("opened above"))
    }

    /// Reads experts `experts` of a layer whose spans are `parts` into `dst`, the i-th at
    /// `i * span`, with all their pieces in flight together. Bytes of a span that no part
    /// covers are zeroed.
    pub fn read(&mut self, parts: &[CopyPart], span: usize, experts: &[u32], dst: &mut [u8]) -> Result<()> {
        assert!(dst.len() >= experts.len() * span, "the staging holds the experts");
        let start = Instant::now();
        let mut pieces = Vec::new();
        for (i, &e) in experts.iter().enumerate() {
            for p in parts {
                let (file, offset) = p.at(e as usize);
                let mut done = 0;
                while done < p.len {
                    let len = PIECE.min(p.len - done);
                    pieces.push(Piece {
                        file,
                        offset: offset + done as u64,
                        len,
                        dst: i * span + p.dst + done,
                    });
                    done += len;
                }
            }
        }
        self.read_pieces(&mut pieces, &mut dst[..experts.len() * span])?;
        self.stats.experts += experts.len() as u64;
        self.stats.bytes += (experts.len() * parts.iter().map(|p| p.len).sum::<usize>()) as u64;
        self.stats.seconds += start.elapsed().as_secs_f64();
        Ok(())
    }

    /// Reads every piece into its place in `dst` (zeroing what none covers), the files checked
    /// first.
    fn read_pieces(&mut self, pieces: &mut [Piece], dst: &mut [u8]) -> Result<()> {
        let mut used: Vec<usize> = pieces.iter().map(|p| p.file).collect();
        used.sort_unstable();
        used.dedup();
        for &f in &used {
            self.open(f)?.check()?;
        }
        // Each piece gets its own slice of `dst`, so the readers write disjoint bytes.
        pieces.sort_unstable_by_key(|p| p.dst);
        let mut jobs = Vec::with_capacity(pieces.len());
        let mut rest = dst;
        let mut at = 0;
        for p in pieces.iter() {
            assert!(p.dst >= at, "expert parts overlap");
            let (gap, tail) = rest.split_at_mut(p.dst - at);
            gap.fill(0);
            let (out, tail) = tail.split_at_mut(p.len);
            jobs.push((*p, out));
            rest = tail;
            at = p.dst + p.len;
        }
        rest.fill(0);
        let files = &self.files;
        readers(&mut self.pool)?.install(|| {
            jobs.into_par_iter().try_for_each(|(p, out)| {
                let f = files[p.file].as_ref().expect("opened above");
                read_piece(f, p.offset, out)
            })
        })
    }

    /// The disk's own read bandwidth, measured over up to `bytes` of the weight files in three
    /// rounds of direct reads with every reader busy, each over other bytes: 4 MiB reads in
    /// order, 1 MiB and 256 KiB reads shuffled (as missed experts are). The best round is
    /// the bound reads of experts are measured against (a disk's speed varies from one
    /// second to the next; the best round is what it can do). Returns (bytes read, seconds)
    /// of the best round. The rounds read the bytes that start `from` bytes into the files
    /// (wrapping), so a later measurement can read other bytes than an earlier one.
    pub fn disk_bandwidth(&mut self, bytes: u64, from: u64) -> Result<(u64, f64)> {
        // Whole 4 MiB blocks of every file, in file order, from `from` on.
        const BIG: u64 = 4 << 20;
        let mut blocks = Vec::new();
        for (f, p) in self.paths.iter().enumerate() {
            if let Some((_, ident)) = p {
                blocks.extend((0..ident.len / BIG).map(|b| (f, b * BIG)));
            }
        }
        if !blocks.is_empty() {
            let skip = (from / BIG) as usize % blocks.len();
            blocks.rotate_left(skip);
        }
        let per_round = ((bytes / 3 / BIG) as usize).min(blocks.len() / 3).max(1);
        let mut rng = Rng::new(0xD15C);
        let mut best: Option<(u64, f64)> = None;
        for (round, (size, shuffled)) in [(4 << 20, false), (1 << 20, true), (256 << 10, true)]
            .into_iter()
            .enumerate()
        {
            let Some(mine) = blocks.get(round * per_round..((round + 1) * per_round).min(blocks.len()))
            else {
                break;
            };
            let mut pieces: Vec<Piece> = mine
                .iter()
                .flat_map(|&(file, at)| {
                    (0..BIG as usize / size).map(move |i| Piece {
                        file,
                        offset: at + (i * size) as u64,
                        len: size,
                        dst: 0,
                    })
                })
                .collect();
            if pieces.is_empty() {
                break;
            }
            if shuffled {
                for i in (1..pieces.len()).rev() {
                    pieces.swap(i, rng.range(0, i + 1));
                }
            }
            // The order they are issued in is the order of `dst`.
            for (i, p) in pieces.iter_mut().enumerate() {
                p.dst = i * size;
            }
            let total = (pieces.len() * size) as u64;
            let mut scratch = vec![0u8; total as usize];
            let start = Instant::now();
            self.read_pieces(&mut pieces, &mut scratch)?;
            let secs = start.elapsed().as_secs_f64();
            if best.is_none_or(|(b, s)| total as f64 / secs > b as f64 / s) {
                best = Some((total, secs));
            }
        }
        Ok(best.unwrap_or((0, 0.0)))
    }
}

/// Reads `out.len()` bytes at `offset` of `f` into `out`: a direct read lands in the reader's
/// aligned space and is copied out; a short read is a file shorter than it was.
fn read_piece(f: &DiskFile, offset: u64, out: &mut [u8]) -> Result<()> {
    let io = |error| ModelError::Io {
        path: f.path.clone(),
        error,
    };
    let truncated = || {
        let len = f.file.metadata().map(|m| m.len()).unwrap_or(0);
        changed(
            &f.path,
            &format!("is now {len} bytes, not the {} it had", f.ident.len),
        )
    };
    if !f.direct {
        return f.file.read_exact_at(out, offset).map_err(|e| match e.kind() {
            std::io::ErrorKind::UnexpectedEof => truncated(),
            _ => io(e),
        });
    }
    let start = offset & !(ALIGN as u64 - 1);
    let head = (offset - start) as usize;
    let want = (head + out.len()).next_multiple_of(ALIGN);
    BOUNCE.with_borrow_mut(|bounce| {
        if bounce.len() < want + ALIGN {
            bounce.resize(want + ALIGN, 0);
        }
        let skip = bounce.as_ptr().align_offset(ALIGN);
        let space = &mut bounce[skip..skip + want];
        let mut got = 0;
        while got < head + out.len() {
            match f.file.read_at(&mut space[got..], start + got as u64) {
                Ok(0) => break,
                Ok(n) => {
                    got += n;
                    // Only the file's end stops a direct read short of a block.
                    if n % ALIGN != 0 {
                        break;
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(io(e)),
            }
        }
        if got < head + out.len() {
            return Err(truncated());
        }
        out.copy_from_slice(&space[head..head + out.len()]);
        Ok(())
    })
}
