//! The weights of a model directory: `model.safetensors`, the shards that
//! `model.safetensors.index.json` lists, or (older MLX directories) every `*.safetensors` file.
//! Files are memory-mapped, never read into memory; a tensor is looked up by name and comes back
//! as its dtype, shape and bytes inside the map. Weights can also be held in memory
//! ([`Weights::from_memory`], for synthetic models built without files).

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};

use kestrel_core::DType;
use memmap2::Mmap;
use safetensors::tensor::{Dtype, SafeTensors, TensorInfo};

use crate::error::{ModelError, Result};

/// Bytes held in memory: as bytes, or as the `u32` words a quantised matrix's values were
/// packed into, kept as they are rather than copied (read as bytes in the host's order, which
/// Kestrel's readers, like its `bytemuck` casts everywhere, take to be little-endian).
pub enum HeldBytes {
    Bytes(Vec<u8>),
    Words(Vec<u32>),
}

impl std::ops::Deref for HeldBytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            HeldBytes::Bytes(v) => v,
            HeldBytes::Words(w) => bytemuck::cast_slice(w),
        }
    }
}

impl From<Vec<u8>> for HeldBytes {
    fn from(v: Vec<u8>) -> Self {
        HeldBytes::Bytes(v)
    }
}

impl From<Vec<u32>> for HeldBytes {
    fn from(w: Vec<u32>) -> Self {
        HeldBytes::Words(w)
    }
}

/// Where a shard's bytes live.
enum Storage {
    Mapped(Mmap),
    Owned(HeldBytes),
    /// A tensor held in memory whose bytes were dropped once the backend had its own copy
    /// ([`Weights::release`]).
    Released,
}

impl std::ops::Deref for Storage {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Storage::Mapped(m) => m,
            Storage::Owned(v) => v,
            Storage::Released => &[],
        }
    }
}

/// One memory-mapped safetensors file, or one tensor held in memory.
struct Shard {
    path: PathBuf,
    map: Storage,
    /// Offset of the tensor data: 8 bytes of header length, then the JSON header.
    data_start: usize,
    /// The file as it was when mapped (None for bytes held in memory).
    ident: Option<FileIdent>,
}

/// A weight file as it was when it was opened: which file (device and inode), its length and
/// its last modification, to tell later reads whether it is still the same file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileIdent {
    pub dev: u64,
    pub ino: u64,
    pub len: u64,
    pub mtime_ns: i128,
}

impl FileIdent {
    pub fn of(meta: &std::fs::Metadata) -> FileIdent {
        use std::os::unix::fs::MetadataExt;
        FileIdent {
            dev: meta.dev(),
            ino: meta.ino(),
            len: meta.size(),
            mtime_ns: meta.mtime() as i128 * 1_000_000_000 + meta.mtime_nsec() as i128,
        }
    }
}

/// Where a tensor's bytes lie in its weight file, for reads that do not go through the map.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileSpan {
    /// Which file: see [`Weights::file`].
    pub file: usize,
    /// Bytes from the start of the file.
    pub offset: u64,
    pub len: usize,
}

/// One tensor, borrowed from its file's map.
#[derive(Debug, Clone, Copy)]
pub struct Tensor<'a> {
    pub name: &'a str,
    pub dtype: DType,
    pub shape: &'a [usize],
    /// Little-endian, row-major.
    pub bytes: &'a [u8],
}

impl Tensor<'_> {
    pub fn elem_count(&self) -> usize {
        self.shape.iter().product()
    }
}

/// A tensor held in memory, for [`Weights::from_memory`].
pub struct OwnedTensor {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
    /// Little-endian, row-major.
    pub bytes: HeldBytes,
}

/// The safetensors dtype of a Kestrel one.
pub(crate) fn st_dtype(d: DType) -> Dtype {
    match d {
        DType::BF16 => Dtype::BF16,
        DType::F16 => Dtype::F16,
        DType::F32 => Dtype::F32,
        DType::U32 => Dtype::U32,
        DType::I32 => Dtype::I32,
        DType::I64 => Dtype::I64,
        DType::U8 => Dtype::U8,
    }
}

/// A weight file mapped into memory (read-only), with what it was when mapped; or a file's
/// bytes held in memory.
pub struct MappedFile {
    pub path: PathBuf,
    map: Storage,
    /// None for bytes held in memory.
    pub ident: Option<FileIdent>,
}

impl MappedFile {
    /// Maps the file at `path`.
    pub fn open(path: &Path) -> Result<MappedFile> {
        let file = File::open(path).map_err(io(path))?;
        // SAFETY: as for a safetensors shard (see `Shard::open`): read-only, and model files are
        // not modified while a model is loaded.
        let map = unsafe { Mmap::map(&file) }.map_err(io(path))?;
        let ident = FileIdent::of(&file.metadata().map_err(io(path))?);
        Ok(MappedFile {
            path: path.to_path_buf(),
            map: Storage::Mapped(map),
            ident: Some(ident),
        })
    }

    /// A file's contents held in memory, named `label` in messages.
    pub fn in_memory(label: &Path, bytes: Vec<u8>) -> MappedFile {
        MappedFile {
            path: label.to_path_buf(),
            map: Storage::Owned(bytes.into()),
            ident: None,
        }
    }

    pub fn bytes(&self) -> &[u8] {
        &self.map
    }
}

/// A tensor lying in file `file` of [`Weights::from_files`], from byte `start` of the file.
pub struct FileTensor {
    pub name: String,
    pub file: usize,
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub start: usize,
}

/// Every tensor of a model directory by name.
pub struct Weights {
    dir: PathBuf,
    shards: Vec<Shard>,
    by_name: HashMap<String, (usize, TensorInfo)>,
}

const INDEX: &str = "model.safetensors.index.json";
const SINGLE: &str = "model.safetensors";

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> ModelError + '_ {
    move |error| ModelError::Io {
        path: path.to_path_buf(),
        error,
    }
}

fn bad_file(path: &Path, reason: impl Into<String>) -> ModelError {
    ModelError::Weights {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

/// A safetensors file whose header the safetensors crate refused, described: which tensor's
/// range is wrong, and how. The crate's own message names no tensor when a range's length does
/// not match the tensor's shape, and names the tensor after a bad range (whose start no longer
/// follows it) otherwise; this finds the tensor at fault. Called only on that error path; None
/// when the header is fine by these checks (the crate's message then stands).
fn diagnose_header(bytes: &[u8]) -> Option<String> {
    let n = u64::from_le_bytes(bytes.get(..8)?.try_into().ok()?);
    let end = 8usize.checked_add(usize::try_from(n).ok()?)?;
    let header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(bytes.get(8..end)?).ok()?;
    let data_len = bytes.len() - end;
    let mut ranges = Vec::new();
    for (name, v) in header.iter().filter(|(k, _)| *k != "__metadata__") {
        let info: TensorInfo = serde_json::from_value(v.clone()).ok()?;
        let (s, e) = info.data_offsets;
        let need = info
            .shape
            .iter()
            .try_fold(info.dtype.bitsize(), |acc, &d| acc.checked_mul(d))
            .map(|bits| bits.div_ceil(8));
        if e < s || Some(e - s) != need {
            let shape = &info.shape;
            let dtype = info.dtype;
            return Some(match need {
                Some(need) => format!(
                    "tensor {name}: its offsets {s}..{e} do not hold its shape {shape:?} of {dtype:?} ({need} bytes)"
                ),
                None => format!("tensor {name}: its shape {shape:?} is too large"),
            });
        }
        if e > data_len {
            return Some(format!(
                "tensor {name} lies outside the file ({s}..{e} of {data_len} bytes of data)"
            ));
        }
        ranges.push((s, e, name));
    }
    ranges.sort();
    let mut at = 0;
    let mut before: Option<&String> = None;
    for (s, e, name) in ranges {
        if s != at {
            let what = if s < at { "overlaps" } else { "leaves a gap after" };
            return Some(match before {
                Some(b) => format!("tensor {name} ({s}..{e}) {what} tensor {b} (which ends at {at})"),
                None => format!("tensor {name} starts at {s}, not at the start of the data"),
            });
        }
        at = e;
        before = Some(name);
    }
    None
}

fn kestrel_dtype(d: Dtype) -> Option<DType> {
    Some(match d {
        Dtype::BF16 => DType::BF16,
        Dtype::F16 => DType::F16,
        Dtype::F32 => DType::F32,
        Dtype::U32 => DType::U32,
        Dtype::I32 => DType::I32,
        Dtype::I64 => DType::I64,
        Dtype::U8 => DType::U8,
        _ => return None,
    })
}

impl Shard {
    fn open(path: PathBuf) -> Result<Shard> {
        let file = File::open(&path).map_err(io(&path))?;
        // SAFETY: the map is read-only and lives as long as this value. Its contents are only
        // sound to read while nobody truncates or rewrites the file underneath; model files are
        // not modified while a model is loaded, which is the usual contract of mapping weights
        // (the same one transformers and llama.cpp rely on).
        let map = unsafe { Mmap::map(&file) }.map_err(io(&path))?;
        let ident = FileIdent::of(&file.metadata().map_err(io(&path))?);
        let mut shard = Shard::of(path, Storage::Mapped(map))?;
        shard.ident = Some(ident);
        Ok(shard)
    }

    /// A safetensors file's bytes held in `map`, under `path` in messages.
    fn of(path: PathBuf, map: Storage) -> Result<Shard> {
        let (header_len, _) = SafeTensors::read_metadata(&map)
            .map_err(|e| bad_file(&path, diagnose_header(&map).unwrap_or_else(|| e.to_string())))?;
        Ok(Shard {
            path,
            map,
            data_start: 8 + header_len,
            ident: None,
        })
    }

    fn tensors(&self) -> Result<Vec<(String, TensorInfo)>> {
        let (_, meta) = SafeTensors::read_metadata(&self.map).map_err(|e| {
            bad_file(
                &self.path,
                diagnose_header(&self.map).unwrap_or_else(|| e.to_string()),
            )
        })?;
        let data_len = self.map.len() - self.data_start;
        let mut out = Vec::new();
        for (name, info) in meta.tensors() {
            let (start, end) = info.data_offsets;
            if start > end || end > data_len {
                return Err(bad_file(
                    &self.path,
                    format!("tensor {name} lies outside the file ({start}..{end} of {data_len} bytes)"),
                ));
            }
            out.push((name, info.clone()));
        }
        Ok(out)
    }
}

impl Weights {
    /// Maps the weight files of `dir` and indexes their tensors.
    pub fn open(dir: &Path) -> Result<Weights> {
        let files = weight_files(dir)?;
        let mut shards = Vec::with_capacity(files.len());
        let mut by_name = HashMap::new();
        for (i, (path, listed)) in files.into_iter().enumerate() {
            let shard = Shard::open(path)?;
            let mut found = Vec::new();
            for (name, info) in shard.tensors()? {
                if let Some(&(other, _)) = by_name.get(&name) {
                    let other: &Shard = &shards[other];
                    return Err(bad_file(
                        &shard.path,
                        format!("tensor {name} is also in {}", other.path.display()),
                    ));
                }
                found.push(name.clone());
                by_name.insert(name, (i, info));
            }
            // Whatever the index says lives in this file must be there.
            if let Some(listed) = listed {
                if let Some(name) = listed.iter().find(|n| !found.contains(n)) {
                    return Err(bad_file(
                        &shard.path,
                        format!("{INDEX} lists tensor {name} in this file, which does not hold it"),
                    ));
                }
            }
            shards.push(shard);
        }
        Ok(Weights {
            dir: dir.to_path_buf(),
            shards,
            by_name,
        })
    }

    /// The tensors of one safetensors file held in memory (the built-in model, embedded in the
    /// binary), under `label` in messages.
    pub fn from_safetensors_bytes(label: &str, bytes: Vec<u8>) -> Result<Weights> {
        let dir = PathBuf::from(label);
        let shard = Shard::of(dir.clone(), Storage::Owned(bytes.into()))?;
        let by_name = shard
            .tensors()?
            .into_iter()
            .map(|(n, info)| (n, (0, info)))
            .collect();
        Ok(Weights {
            dir,
            shards: vec![shard],
            by_name,
        })
    }

    /// Tensors held in memory, under `label` (in place of a directory in messages). A name
    /// given twice or bytes that do not match a shape are errors.
    pub fn from_memory(label: &str, tensors: Vec<OwnedTensor>) -> Result<Weights> {
        let dir = PathBuf::from(label);
        let mut shards = Vec::with_capacity(tensors.len());
        let mut by_name = HashMap::new();
        for (i, t) in tensors.into_iter().enumerate() {
            let expect = t.shape.iter().product::<usize>() * t.dtype.size_in_bytes();
            if t.bytes.len() != expect || by_name.contains_key(&t.name) {
                return Err(bad_file(
                    &dir,
                    format!(
                        "tensor {}: {} bytes for shape {:?} of {}, or given twice",
                        t.name,
                        t.bytes.len(),
                        t.shape,
                        t.dtype
                    ),
                ));
            }
            let info = TensorInfo {
                dtype: st_dtype(t.dtype),
                shape: t.shape,
                data_offsets: (0, t.bytes.len()),
            };
            by_name.insert(t.name, (i, info));
            shards.push(Shard {
                path: dir.clone(),
                map: Storage::Owned(t.bytes),
                data_start: 0,
                ident: None,
            });
        }
        Ok(Weights { dir, shards, by_name })
    }

    /// Tensors lying in mapped files (`views`, read in place) and tensors held in memory
    /// (`owned`), under `label` (the file or directory named in messages): how a model file in
    /// another format than safetensors (GGUF) is read. A name given twice, or a tensor whose bytes
    /// pass its file's end, is an error.
    pub fn from_files(
        label: &Path,
        files: Vec<MappedFile>,
        views: Vec<FileTensor>,
        owned: Vec<OwnedTensor>,
    ) -> Result<Weights> {
        let mut shards: Vec<Shard> = files
            .into_iter()
            .map(|f| Shard {
                path: f.path,
                map: f.map,
                data_start: 0,
                ident: f.ident,
            })
            .collect();
        let mut by_name = HashMap::new();
        for t in views {
            let shard = shards
                .get(t.file)
                .ok_or_else(|| bad_file(label, format!("tensor {}: no file {}", t.name, t.file)))?;
            let len = t
                .shape
                .iter()
                .try_fold(t.dtype.size_in_bytes(), |a, &d| a.checked_mul(d));
            let end = len.and_then(|l| t.start.checked_add(l));
            if end.is_none_or(|e| e > shard.map.len()) || by_name.contains_key(&t.name) {
                return Err(bad_file(
                    &shard.path,
                    format!(
                        "tensor {} ({:?} of {} from byte {}) passes the file's end or is given twice",
                        t.name, t.shape, t.dtype, t.start
                    ),
                ));
            }
            let info = TensorInfo {
                dtype: st_dtype(t.dtype),
                shape: t.shape,
                data_offsets: (t.start, end.expect("checked above")),
            };
            by_name.insert(t.name, (t.file, info));
        }
        let held = Weights::from_memory(&label.display().to_string(), owned)?;
        for (name, (i, info)) in held.by_name {
            if by_name.contains_key(&name) {
                return Err(bad_file(label, format!("tensor {name} is given twice")));
            }
            by_name.insert(name, (shards.len() + i, info));
        }
        shards.extend(held.shards);
        Ok(Weights {
            dir: label.to_path_buf(),
            shards,
            by_name,
        })
    }

    /// The tensor called `name`, or an error naming it and the directory.
    pub fn get(&self, name: &str) -> Result<Tensor<'_>> {
        let Some((key, (shard, info))) = self.by_name.get_key_value(name) else {
            return Err(ModelError::MissingTensor {
                name: name.to_string(),
                dir: self.dir.clone(),
            });
        };
        let shard = &self.shards[*shard];
        if matches!(shard.map, Storage::Released) {
            return Err(bad_file(
                &shard.path,
                format!("tensor {name} was dropped from memory once the backend held a copy"),
            ));
        }
        let dtype = kestrel_dtype(info.dtype).ok_or_else(|| {
            bad_file(
                &shard.path,
                format!(
                    "tensor {name} has dtype {:?}, which Kestrel does not read",
                    info.dtype
                ),
            )
        })?;
        let (start, end) = info.data_offsets;
        let bytes = &shard.map[shard.data_start + start..shard.data_start + end];
        let expect = info.shape.iter().product::<usize>() * dtype.size_in_bytes();
        if bytes.len() != expect {
            return Err(bad_file(
                &shard.path,
                format!(
                    "tensor {name}: {} bytes for shape {:?} of {dtype}",
                    bytes.len(),
                    info.shape
                ),
            ));
        }
        Ok(Tensor {
            name: key,
            dtype,
            shape: &info.shape,
            bytes,
        })
    }

    /// Where tensor `name`'s bytes lie in its file: None when the weights are held in memory
    /// or there is no such tensor.
    pub fn file_span(&self, name: &str) -> Option<FileSpan> {
        let (shard, info) = self.by_name.get(name)?;
        let s = &self.shards[*shard];
        s.ident?;
        let (start, end) = info.data_offsets;
        Some(FileSpan {
            file: *shard,
            offset: (s.data_start + start) as u64,
            len: end - start,
        })
    }

    /// The path of weight file `file` (a [`FileSpan::file`]) and what it was when mapped.
    pub fn file(&self, file: usize) -> Option<(&Path, FileIdent)> {
        let s = self.shards.get(file)?;
        Some((&s.path, s.ident?))
    }

    /// Drops the bytes of tensor `name` when it is held in memory on its own (a synthetic
    /// model's, [`Weights::from_memory`]) and nothing will read it again (the backend holds a
    /// copy); later lookups of it are errors saying so. Returns whether memory was freed:
    /// mapped files and tensors sharing a buffer are left as they are.
    pub fn release(&mut self, name: &str) -> bool {
        let Some((shard, info)) = self.by_name.get(name) else {
            return false;
        };
        let s = &mut self.shards[*shard];
        // A shard of `from_memory` holds one tensor, all its bytes; a file held in memory (a
        // GGUF read from bytes) holds a header and other tensors too.
        if matches!(s.map, Storage::Owned(_)) && s.data_start == 0 && info.data_offsets == (0, s.map.len()) {
            s.map = Storage::Released;
            return true;
        }
        false
    }

    pub fn contains(&self, name: &str) -> bool {
        self.by_name.contains_key(name)
    }

    /// Every tensor name, sorted.
    pub fn names(&self) -> Vec<&str> {
        let mut names: Vec<&str> = self.by_name.keys().map(String::as_str).collect();
        names.sort_unstable();
        names
    }

    /// Bytes of tensor data across all files.
    pub fn total_bytes(&self) -> usize {
        self.by_name
            .values()
            .map(|(_, info)| info.data_offsets.1 - info.data_offsets.0)
            .sum()
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Bytes of the mapped weight files, whole (a GGUF file's size, or a directory's
    /// safetensors files with their headers).
    pub fn file_bytes(&self) -> u64 {
        self.shards.iter().filter_map(|s| s.ident).map(|i| i.len).sum()
    }
}

/// The files to map, each with the tensor names the index assigns to it (None without an index).
fn weight_files(dir: &Path) -> Result<Vec<(PathBuf, Option<Vec<String>>)>> {
    let index = dir.join(INDEX);
    if index.exists() {
        let text = std::fs::read_to_string(&index).map_err(io(&index))?;
        let value: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| bad_file(&index, format!("not valid JSON: {e}")))?;
        let map = value
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| bad_file(&index, "no weight_map object"))?;
        let mut files: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for (name, file) in map {
            let file = file
                .as_str()
                .ok_or_else(|| bad_file(&index, format!("weight_map entry {name} is not a file name")))?;
            if file.contains('/') || file.contains('\\') || file == ".." {
                return Err(bad_file(
                    &index,
                    format!("weight_map names {file:?}, outside the directory"),
                ));
            }
            files.entry(file.to_string()).or_default().push(name.clone());
        }
        if files.is_empty() {
            return Err(bad_file(&index, "weight_map is empty"));
        }
        return Ok(files
            .into_iter()
            .map(|(f, names)| (dir.join(f), Some(names)))
            .collect());
    }
    let single = dir.join(SINGLE);
    if single.exists() {
        return Ok(vec![(single, None)]);
    }
    let entries = std::fs::read_dir(dir).map_err(io(dir))?;
    let mut files = Vec::new();
    for entry in entries {
        let path = entry.map_err(io(dir))?.path();
        if path.extension().is_some_and(|e| e == "safetensors") {
            files.push((path, None));
        }
    }
    if files.is_empty() {
        return Err(ModelError::Weights {
            path: dir.to_path_buf(),
            reason: format!("no {SINGLE}, {INDEX} or other *.safetensors file"),
        });
    }
    files.sort();
    Ok(files)
}
