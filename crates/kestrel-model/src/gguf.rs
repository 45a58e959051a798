//! GGUF files (llama.cpp's format, versions 2 and 3, little-endian): the header, the key-value
//! metadata and the tensor infos read from the file's bytes (usually memory-mapped), every
//! count, length, offset and size checked against the bytes before it is used, so that no input
//! makes the reader allocate more than the file holds, read past it or overflow.
//!
//! Layout: magic `GGUF`, version (u32), tensor count and key-value count (u64 each); the
//! key-value pairs (key string, value type u32, value); the tensor infos (name string, dims u32,
//! one u64 per dim with the fastest-varying first, ggml type u32, offset u64 into the data
//! section); padding to `general.alignment` (32 by default); the data section, each tensor at its
//! offset, which is a multiple of the alignment. Strings are a u64 length and UTF-8 bytes; arrays
//! are an element type (u32), a u64 count and the elements.

use std::collections::HashMap;

/// The most dimensions a tensor has (ggml's `GGML_MAX_DIMS`).
pub const MAX_DIMS: usize = 4;

/// The alignment of the data section and of every tensor in it, unless `general.alignment` says.
pub const DEFAULT_ALIGNMENT: u64 = 32;

/// What is wrong with a GGUF file: where (a byte offset, a key or a tensor) and why.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum GgufError {
    #[error("not a GGUF file (it starts with {0:?}, not \"GGUF\")")]
    Magic([u8; 4]),
    #[error("GGUF version {0} is not supported (versions 2 and 3 are)")]
    Version(u32),
    #[error("the file ends at byte {len}, inside {what} (which needs bytes up to {need})")]
    Truncated { what: String, need: u64, len: u64 },
    #[error("{what}: {reason}")]
    Invalid { what: String, reason: String },
}

type Result<T> = std::result::Result<T, GgufError>;

fn invalid(what: impl Into<String>, reason: impl Into<String>) -> GgufError {
    GgufError::Invalid {
        what: what.into(),
        reason: reason.into(),
    }
}

/// A ggml tensor type: its id in the file, name, values per block and bytes per block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct GgmlType {
    pub id: u32,
    pub name: &'static str,
    pub block: u64,
    pub block_bytes: u64,
}

/// Every tensor type a GGUF file may name (ggml's `ggml_type`, with the ids it has retired left
/// out): id, name, values per block, bytes per block.
const GGML_TYPES: &[(u32, &str, u64, u64)] = &[
    (0, "F32", 1, 4),
    (1, "F16", 1, 2),
    (2, "Q4_0", 32, 18),
    (3, "Q4_1", 32, 20),
    (6, "Q5_0", 32, 22),
    (7, "Q5_1", 32, 24),
    (8, "Q8_0", 32, 34),
    (9, "Q8_1", 32, 40),
    (10, "Q2_K", 256, 84),
    (11, "Q3_K", 256, 110),
    (12, "Q4_K", 256, 144),
    (13, "Q5_K", 256, 176),
    (14, "Q6_K", 256, 210),
    (15, "Q8_K", 256, 292),
    (16, "IQ2_XXS", 256, 66),
    (17, "IQ2_XS", 256, 74),
    (18, "IQ3_XXS", 256, 98),
    (19, "IQ1_S", 256, 50),
    (20, "IQ4_NL", 32, 18),
    (21, "IQ3_S", 256, 110),
    (22, "IQ2_S", 256, 82),
    (23, "IQ4_XS", 256, 136),
    (24, "I8", 1, 1),
    (25, "I16", 1, 2),
    (26, "I32", 1, 4),
    (27, "I64", 1, 8),
    (28, "F64", 1, 8),
    (29, "IQ1_M", 256, 56),
    (30, "BF16", 1, 2),
    (34, "TQ1_0", 256, 54),
    (35, "TQ2_0", 256, 66),
    (39, "MXFP4", 32, 17),
];

impl GgmlType {
    /// The type with id `id`, if ggml has one.
    pub fn from_id(id: u32) -> Option<GgmlType> {
        GGML_TYPES
            .iter()
            .find(|t| t.0 == id)
            .map(|&(id, name, block, block_bytes)| GgmlType {
                id,
                name,
                block,
                block_bytes,
            })
    }
}

/// A metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Array),
}

/// An array value: elements of one type, never arrays themselves, kept as a vector of that
/// type (so an array costs in memory about what it takes in the file).
#[derive(Debug, Clone, PartialEq)]
pub enum Array {
    U8(Vec<u8>),
    I8(Vec<i8>),
    U16(Vec<u16>),
    I16(Vec<i16>),
    U32(Vec<u32>),
    I32(Vec<i32>),
    U64(Vec<u64>),
    I64(Vec<i64>),
    F32(Vec<f32>),
    F64(Vec<f64>),
    Bool(Vec<bool>),
    String(Vec<String>),
}

impl Array {
    pub fn len(&self) -> usize {
        match self {
            Array::U8(v) => v.len(),
            Array::I8(v) => v.len(),
            Array::U16(v) => v.len(),
            Array::I16(v) => v.len(),
            Array::U32(v) => v.len(),
            Array::I32(v) => v.len(),
            Array::U64(v) => v.len(),
            Array::I64(v) => v.len(),
            Array::F32(v) => v.len(),
            Array::F64(v) => v.len(),
            Array::Bool(v) => v.len(),
            Array::String(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn strings(&self) -> Option<&[String]> {
        match self {
            Array::String(v) => Some(v),
            _ => None,
        }
    }

    /// The elements as i64, from any integer type (u64 past i64's range: None).
    pub fn ints(&self) -> Option<Vec<i64>> {
        fn all<T: Copy>(v: &[T], f: impl Fn(T) -> Option<i64>) -> Option<Vec<i64>> {
            v.iter().map(|&x| f(x)).collect()
        }
        match self {
            Array::U8(v) => all(v, |x| Some(x.into())),
            Array::I8(v) => all(v, |x| Some(x.into())),
            Array::U16(v) => all(v, |x| Some(x.into())),
            Array::I16(v) => all(v, |x| Some(x.into())),
            Array::U32(v) => all(v, |x| Some(x.into())),
            Array::I32(v) => all(v, |x| Some(x.into())),
            Array::U64(v) => all(v, |x| i64::try_from(x).ok()),
            Array::I64(v) => Some(v.clone()),
            _ => None,
        }
    }

    /// The elements as f32, from f32 (or f64, rounded).
    pub fn floats(&self) -> Option<Vec<f32>> {
        match self {
            Array::F32(v) => Some(v.clone()),
            Array::F64(v) => Some(v.iter().map(|&x| x as f32).collect()),
            _ => None,
        }
    }
}

impl Value {
    /// The value as an unsigned integer, from any integer type that holds a non-negative one.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v.into()),
            Value::U16(v) => Some(v.into()),
            Value::U32(v) => Some(v.into()),
            Value::U64(v) => Some(v),
            Value::I8(v) => u64::try_from(v).ok(),
            Value::I16(v) => u64::try_from(v).ok(),
            Value::I32(v) => u64::try_from(v).ok(),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v.into()),
            Value::F64(v) => Some(v),
            _ => self.as_u64().map(|v| v as f64),
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&Array> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }

    /// The name of the value's type, for messages.
    pub fn type_name(&self) -> &'static str {
        match self {
            Value::U8(_) => "u8",
            Value::I8(_) => "i8",
            Value::U16(_) => "u16",
            Value::I16(_) => "i16",
            Value::U32(_) => "u32",
            Value::I32(_) => "i32",
            Value::U64(_) => "u64",
            Value::I64(_) => "i64",
            Value::F32(_) => "f32",
            Value::F64(_) => "f64",
            Value::Bool(_) => "bool",
            Value::String(_) => "string",
            Value::Array(_) => "array",
        }
    }
}

/// One tensor's info: its name, dims (fastest-varying first, as ggml orders them), type, and
/// where its bytes lie in the file.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    pub name: String,
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    /// Offset of its first byte from the start of the file, and its length.
    pub start: u64,
    pub bytes: u64,
}

impl TensorInfo {
    pub fn elem_count(&self) -> u64 {
        self.dims.iter().product()
    }

    /// Its bytes in `file` (the bytes the info was read from; checked when it was read).
    pub fn data<'a>(&self, file: &'a [u8]) -> &'a [u8] {
        &file[self.start as usize..(self.start + self.bytes) as usize]
    }
}

/// A GGUF file's header, metadata and tensor infos, checked against its length.
#[derive(Debug, Clone)]
pub struct Gguf {
    pub version: u32,
    /// Keys in file order, and each key's value.
    keys: Vec<String>,
    values: HashMap<String, Value>,
    pub tensors: Vec<TensorInfo>,
    by_name: HashMap<String, usize>,
    pub alignment: u64,
    /// Where the data section starts.
    pub data_start: u64,
}

/// The bytes a value of type `ty` takes at least (an empty string or array: its length alone).
fn min_value_bytes(ty: u32) -> u64 {
    match ty {
        0 | 1 | 7 => 1,
        2 | 3 => 2,
        4..=6 => 4,
        10..=12 => 8,
        8 => 8,
        9 => 12,
        _ => 1,
    }
}

/// A cursor over the file's bytes that refuses to read past them.
struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: u64, what: &dyn Fn() -> String) -> Result<&'a [u8]> {
        let left = (self.bytes.len() - self.pos) as u64;
        if n > left {
            return Err(GgufError::Truncated {
                what: what(),
                need: (self.pos as u64).saturating_add(n),
                len: self.bytes.len() as u64,
            });
        }
        let out = &self.bytes[self.pos..self.pos + n as usize];
        self.pos += n as usize;
        Ok(out)
    }

    fn left(&self) -> u64 {
        (self.bytes.len() - self.pos) as u64
    }

    fn array<const N: usize>(&mut self, what: &dyn Fn() -> String) -> Result<[u8; N]> {
        Ok(self.take(N as u64, what)?.try_into().expect("took N bytes"))
    }

    fn u32(&mut self, what: &dyn Fn() -> String) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &dyn Fn() -> String) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    fn string(&mut self, what: &dyn Fn() -> String) -> Result<String> {
        let len = self.u64(what)?;
        let bytes = self.take(len, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|e| invalid(what(), format!("not UTF-8 ({e})")))
    }

    /// A value of type `ty`.
    fn value(&mut self, ty: u32, what: &dyn Fn() -> String) -> Result<Value> {
        Ok(match ty {
            0 => Value::U8(self.array::<1>(what)?[0]),
            1 => Value::I8(i8::from_le_bytes(self.array(what)?)),
            2 => Value::U16(u16::from_le_bytes(self.array(what)?)),
            3 => Value::I16(i16::from_le_bytes(self.array(what)?)),
            4 => Value::U32(self.u32(what)?),
            5 => Value::I32(i32::from_le_bytes(self.array(what)?)),
            6 => Value::F32(f32::from_le_bytes(self.array(what)?)),
            7 => match self.array::<1>(what)?[0] {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                b => return Err(invalid(what(), format!("a bool of byte {b}, not 0 or 1"))),
            },
            8 => Value::String(self.string(what)?),
            9 => Value::Array(self.array_value(what)?),
            10 => Value::U64(self.u64(what)?),
            11 => Value::I64(i64::from_le_bytes(self.array(what)?)),
            12 => Value::F64(f64::from_le_bytes(self.array(what)?)),
            t => return Err(invalid(what(), format!("unknown value type {t}"))),
        })
    }
}

impl Reader<'_> {
    /// An array: its element type, count, and elements of that one type.
    fn array_value(&mut self, what: &dyn Fn() -> String) -> Result<Array> {
        let elem = self.u32(what)?;
        let count = self.u64(what)?;
        // Every element takes bytes of the file: a count the rest of the file cannot hold is
        // refused before anything is allocated for it.
        let least = count.checked_mul(min_value_bytes(elem));
        if least.is_none_or(|b| b > self.left()) {
            return Err(GgufError::Truncated {
                what: format!("{} ({count} elements of type {elem})", what()),
                need: (self.pos as u64).saturating_add(least.unwrap_or(u64::MAX)),
                len: self.bytes.len() as u64,
            });
        }
        let n = count as usize;
        // Element i of a vector of T, read as value type `elem`.
        macro_rules! each {
            ($variant:ident) => {{
                let mut out = Vec::with_capacity(n);
                for i in 0..n {
                    match self.value(elem, &|| format!("{}[{i}]", what()))? {
                        Value::$variant(x) => out.push(x),
                        _ => unreachable!("value() reads the type it is given"),
                    }
                }
                Array::$variant(out)
            }};
        }
        Ok(match elem {
            0 => each!(U8),
            1 => each!(I8),
            2 => each!(U16),
            3 => each!(I16),
            4 => each!(U32),
            5 => each!(I32),
            6 => each!(F32),
            7 => each!(Bool),
            8 => each!(String),
            9 => return Err(invalid(what(), "an array of arrays")),
            10 => each!(U64),
            11 => each!(I64),
            12 => each!(F64),
            t => return Err(invalid(what(), format!("an array of unknown value type {t}"))),
        })
    }
}

impl Gguf {
    /// Reads the header, metadata and tensor infos of the GGUF file `bytes`, checking every
    /// tensor's bytes lie inside it, aligned, without overlapping another's.
    pub fn parse(bytes: &[u8]) -> Result<Gguf> {
        let mut r = Reader { bytes, pos: 0 };
        let magic: [u8; 4] = r.array(&|| "the magic".into())?;
        if &magic != b"GGUF" {
            return Err(GgufError::Magic(magic));
        }
        let version = r.u32(&|| "the version".into())?;
        if !(2..=3).contains(&version) {
            return Err(GgufError::Version(version));
        }
        let n_tensors = r.u64(&|| "the tensor count".into())?;
        let n_kv = r.u64(&|| "the key-value count".into())?;
        // A key-value pair takes at least 13 bytes (an empty key, the type, a u8), a tensor
        // info at least 28 (an empty name, one dim, the type, the offset).
        let fits = |n: u64, each: u64, left: u64| n.checked_mul(each).is_some_and(|b| b <= left);
        if !fits(n_kv, 13, r.left()) {
            return Err(invalid(
                "the key-value count",
                format!("{n_kv} pairs cannot fit in the file"),
            ));
        }
        let mut keys = Vec::with_capacity(n_kv as usize);
        let mut values = HashMap::with_capacity(n_kv as usize);
        for i in 0..n_kv {
            let key = r.string(&|| format!("key {i}"))?;
            let ty = r.u32(&|| format!("the type of key {key:?}"))?;
            let value = r.value(ty, &|| format!("the value of key {key:?}"))?;
            if values.insert(key.clone(), value).is_some() {
                return Err(invalid(format!("key {key:?}"), "given twice"));
            }
            keys.push(key);
        }
        let alignment = match values.get("general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(Value::U32(a)) if a.is_power_of_two() => u64::from(*a),
            Some(v) => {
                return Err(invalid(
                    "general.alignment",
                    format!("{v:?}: a power of two as a u32 expected"),
                ))
            }
        };
        if !fits(n_tensors, 28, r.left()) {
            return Err(invalid(
                "the tensor count",
                format!("{n_tensors} tensor infos cannot fit in the file"),
            ));
        }
        let mut infos = Vec::with_capacity(n_tensors as usize);
        for i in 0..n_tensors {
            let name = r.string(&|| format!("the name of tensor {i}"))?;
            let what = || format!("tensor {name:?}");
            let n_dims = r.u32(&what)?;
            if n_dims == 0 || n_dims as usize > MAX_DIMS {
                return Err(invalid(
                    what(),
                    format!("{n_dims} dims (1 to {MAX_DIMS} expected)"),
                ));
            }
            let mut dims = Vec::with_capacity(n_dims as usize);
            for _ in 0..n_dims {
                dims.push(r.u64(&what)?);
            }
            let ty_id = r.u32(&what)?;
            let offset = r.u64(&what)?;
            let ty = GgmlType::from_id(ty_id)
                .ok_or_else(|| invalid(what(), format!("unknown tensor type {ty_id}")))?;
            let count = dims.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
            let count = match count {
                Some(c) if c > 0 && c <= i64::MAX as u64 => c,
                _ => {
                    return Err(invalid(
                        what(),
                        format!("dims {dims:?}: no elements, or too many"),
                    ))
                }
            };
            if dims[0] % ty.block != 0 {
                return Err(invalid(
                    what(),
                    format!(
                        "rows of {} values are not whole {} blocks of {}",
                        dims[0], ty.name, ty.block
                    ),
                ));
            }
            // count / block <= 2^63 / 1, times at most 292 bytes a block: checked.
            let bytes = (count / ty.block)
                .checked_mul(ty.block_bytes)
                .ok_or_else(|| invalid(what(), "its size overflows"))?;
            if offset % alignment != 0 {
                return Err(invalid(
                    what(),
                    format!("offset {offset} is not a multiple of the alignment {alignment}"),
                ));
            }
            infos.push((name, dims, ty, offset, bytes));
        }
        let data_start = (r.pos as u64).next_multiple_of(alignment);
        let len = bytes.len() as u64;
        let mut tensors = Vec::with_capacity(infos.len());
        let mut by_name = HashMap::with_capacity(infos.len());
        for (name, dims, ty, offset, size) in infos {
            let start = data_start.checked_add(offset);
            let end = start.and_then(|s| s.checked_add(size));
            let (Some(start), Some(end)) = (start, end) else {
                return Err(invalid(format!("tensor {name:?}"), "its offset overflows"));
            };
            if end > len {
                return Err(GgufError::Truncated {
                    what: format!("tensor {name:?} ({size} bytes at data offset {offset})"),
                    need: end,
                    len,
                });
            }
            if by_name.insert(name.clone(), tensors.len()).is_some() {
                return Err(invalid(format!("tensor {name:?}"), "listed twice"));
            }
            tensors.push(TensorInfo {
                name,
                dims,
                ty,
                start,
                bytes: size,
            });
        }
        let mut spans: Vec<(u64, u64, usize)> = tensors
            .iter()
            .enumerate()
            .map(|(i, t)| (t.start, t.start + t.bytes, i))
            .collect();
        spans.sort_unstable();
        for w in spans.windows(2) {
            if w[1].0 < w[0].1 {
                return Err(invalid(
                    format!("tensor {:?}", tensors[w[1].2].name),
                    format!("its bytes overlap those of {:?}", tensors[w[0].2].name),
                ));
            }
        }
        Ok(Gguf {
            version,
            keys,
            values,
            tensors,
            by_name,
            alignment,
            data_start,
        })
    }

    /// The metadata keys in file order.
    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.keys.iter().map(String::as_str)
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.values.get(key)
    }

    /// An integer value that must be there.
    pub fn u64(&self, key: &str) -> Result<u64> {
        let v = self
            .get(key)
            .ok_or_else(|| invalid(format!("key {key:?}"), "missing"))?;
        v.as_u64().ok_or_else(|| {
            invalid(
                format!("key {key:?}"),
                format!("a non-negative integer expected, not {}", v.type_name()),
            )
        })
    }

    /// A string value that must be there.
    pub fn str(&self, key: &str) -> Result<&str> {
        let v = self
            .get(key)
            .ok_or_else(|| invalid(format!("key {key:?}"), "missing"))?;
        v.as_str().ok_or_else(|| {
            invalid(
                format!("key {key:?}"),
                format!("a string expected, not {}", v.type_name()),
            )
        })
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.by_name.get(name).map(|&i| &self.tensors[i])
    }
}

/// Token types of `tokenizer.ggml.token_type` (llama.cpp's `llama_token_type`).
const TOKEN_NORMAL: i64 = 1;
const TOKEN_UNKNOWN: i64 = 2;
const TOKEN_CONTROL: i64 = 3;
const TOKEN_USER_DEFINED: i64 = 4;

/// The byte-level BPE pre-tokenisers GGUF names in `tokenizer.ggml.pre` that Kestrel reads, with
/// the split pattern of their models' `tokenizer.json`, and whether merges are skipped for a
/// piece that is itself a token (Llama 3's `ignore_merges`).
const BPE_PRE: &[(&str, &str, bool)] = &[
    (
        "qwen2",
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        false,
    ),
    (
        "qwen35",
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        false,
    ),
    (
        "llama-bpe",
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        true,
    ),
];

impl Gguf {
    /// The file's tokenizer as a Hugging Face `tokenizer.json` value, for the tokenizer the engine
    /// reads from one: `tokenizer.ggml.model` "gpt2" (byte-level BPE) with `tokens`, `merges`,
    /// `token_type` (control tokens special, user-defined ones added but not special) and a
    /// pre-tokeniser `tokenizer.ggml.pre` names (qwen2, qwen35, llama-bpe), and the beginning
    /// token added in front when `tokenizer.ggml.add_bos_token` says so.
    pub fn tokenizer_json(&self) -> Result<serde_json::Value> {
        use serde_json::{json, Value as Json};
        let model = self.str("tokenizer.ggml.model")?;
        if model == "llama" {
            return self.sentencepiece_json();
        }
        if model != "gpt2" {
            return Err(invalid(
                "tokenizer.ggml.model",
                format!(
                    "{model:?}: only \"gpt2\" (byte-level BPE) and \"llama\" (SentencePiece BPE) \
                     tokenizers are read"
                ),
            ));
        }
        let pre = self.str("tokenizer.ggml.pre")?;
        let &(_, pattern, ignore_merges) = BPE_PRE.iter().find(|p| p.0 == pre).ok_or_else(|| {
            let known: Vec<&str> = BPE_PRE.iter().map(|p| p.0).collect();
            invalid(
                "tokenizer.ggml.pre",
                format!(
                    "{pre:?} is not a pre-tokenizer Kestrel reads ({})",
                    known.join(", ")
                ),
            )
        })?;
        let strings = |key: &str| -> Result<&[String]> {
            self.get(key)
                .and_then(Value::as_array)
                .and_then(Array::strings)
                .ok_or_else(|| invalid(format!("key {key:?}"), "missing, or not an array of strings"))
        };
        let (tokens, types) = self.tokens_and_types()?;
        // A vocabulary of single symbols has no merges, and llama.cpp's converter then writes
        // no key.
        let merges = match self.get("tokenizer.ggml.merges") {
            None => &[][..],
            Some(_) => strings("tokenizer.ggml.merges")?,
        };
        let VocabJson { vocab, added, .. } = vocab_json(tokens, &types)?;
        let byte_level = json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false});
        let add_bos = matches!(self.get("tokenizer.ggml.add_bos_token"), Some(Value::Bool(true)));
        let post = match (
            add_bos,
            self.special_id("tokenizer.ggml.bos_token_id", None, tokens.len())?,
        ) {
            (true, Some(id)) => bos_in_front(tokens, id),
            (true, None) => {
                return Err(invalid(
                    "tokenizer.ggml.add_bos_token",
                    "true, but no tokenizer.ggml.bos_token_id",
                ))
            }
            (false, _) => byte_level.clone(),
        };
        Ok(json!({
            "version": "1.0",
            "truncation": Json::Null,
            "padding": Json::Null,
            "added_tokens": added,
            "normalizer": Json::Null,
            "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": false},
                byte_level,
            ]},
            "post_processor": post,
            "decoder": byte_level,
            "model": {
                "type": "BPE", "dropout": Json::Null, "unk_token": Json::Null,
                "continuing_subword_prefix": Json::Null, "end_of_word_suffix": Json::Null,
                "fuse_unk": false, "byte_fallback": false, "ignore_merges": ignore_merges,
                "vocab": vocab, "merges": merges,
            },
        }))
    }
}

/// What the beginning, end and unknown tokens are when a SentencePiece file does not say (as
/// llama.cpp assumes for its "llama" vocabularies).
pub const SPM_DEFAULT_IDS: (u64, u64, u64) = (1, 2, 0);

/// A vocabulary as `tokenizer.json` holds it.
struct VocabJson<'a> {
    /// Each token, listed once, by its id.
    vocab: serde_json::Map<String, serde_json::Value>,
    /// Control and unknown tokens (special) and user-defined ones (added, not special).
    added: Vec<serde_json::Value>,
    /// The normal tokens' ids by text.
    normal: HashMap<&'a str, usize>,
}

fn vocab_json<'a>(tokens: &'a [String], types: &[i64]) -> Result<VocabJson<'a>> {
    use serde_json::json;
    let mut v = VocabJson {
        vocab: serde_json::Map::with_capacity(tokens.len()),
        added: Vec::new(),
        normal: HashMap::new(),
    };
    for (id, (token, &ty)) in tokens.iter().zip(types).enumerate() {
        if v.vocab.insert(token.clone(), json!(id)).is_some() {
            return Err(invalid(
                "tokenizer.ggml.tokens",
                format!("{token:?} is listed twice"),
            ));
        }
        if ty == TOKEN_NORMAL {
            v.normal.insert(token.as_str(), id);
        }
        if ty == TOKEN_CONTROL || ty == TOKEN_UNKNOWN || ty == TOKEN_USER_DEFINED {
            v.added.push(json!({
                "id": id, "content": token, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": ty != TOKEN_USER_DEFINED,
            }));
        }
    }
    Ok(v)
}

/// The post-processor that puts token `id` (checked to be one of `tokens`) in front.
fn bos_in_front(tokens: &[String], id: u64) -> serde_json::Value {
    let (b, id) = (tokens[id as usize].as_str(), id as u32);
    serde_json::json!({
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": b, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"SpecialToken": {"id": b, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                 {"SpecialToken": {"id": b, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {b: {"id": b, "ids": [id], "tokens": [b]}},
    })
}

impl Gguf {
    /// The tokens' texts and types (`tokenizer.ggml.tokens`, `token_type`, every type 1 when the
    /// file gives none), checked to be as many.
    fn tokens_and_types(&self) -> Result<(&[String], Vec<i64>)> {
        let tokens = self
            .get("tokenizer.ggml.tokens")
            .and_then(Value::as_array)
            .and_then(Array::strings)
            .ok_or_else(|| {
                invalid(
                    "key \"tokenizer.ggml.tokens\"",
                    "missing, or not an array of strings",
                )
            })?;
        let types = match self.get("tokenizer.ggml.token_type") {
            None => vec![1; tokens.len()],
            Some(v) => v
                .as_array()
                .and_then(Array::ints)
                .ok_or_else(|| invalid("tokenizer.ggml.token_type", "not an array of integers"))?,
        };
        if types.len() != tokens.len() {
            return Err(invalid(
                "tokenizer.ggml.token_type",
                format!("{} types for {} tokens", types.len(), tokens.len()),
            ));
        }
        Ok((tokens, types))
    }

    /// A token id of key `key`, or `default`, checked against the vocabulary.
    fn special_id(&self, key: &str, default: Option<u64>, tokens: usize) -> Result<Option<u64>> {
        let id = match self.get(key) {
            Some(v) => Some(
                v.as_u64()
                    .ok_or_else(|| invalid(format!("key {key:?}"), "not a token id"))?,
            ),
            None => default,
        };
        match id {
            Some(i) if i >= tokens as u64 => Err(invalid(
                format!("key {key:?}"),
                format!("{i} is not a token id below {tokens}"),
            )),
            other => Ok(other),
        }
    }

    /// A SentencePiece BPE vocabulary (`tokenizer.ggml.model` "llama": tokens, scores, token
    /// types, byte tokens `<0xXX>` for what no piece covers) as a `tokenizer.json` value that
    /// encodes as SentencePiece does: spaces as "▁" and one in front of the text (unless
    /// `add_space_prefix` is false), pieces merged highest score first (the merges of every
    /// normal piece split into two normal pieces, ranked by its score, as transformers builds
    /// them from a SentencePiece model), bytes for the rest; the beginning token in front unless
    /// `add_bos_token` is false.
    fn sentencepiece_json(&self) -> Result<serde_json::Value> {
        use serde_json::{json, Value as Json};
        let (tokens, types) = self.tokens_and_types()?;
        let scores = self
            .get("tokenizer.ggml.scores")
            .and_then(Value::as_array)
            .and_then(Array::floats)
            .ok_or_else(|| {
                invalid(
                    "key \"tokenizer.ggml.scores\"",
                    "missing, or not an array of numbers",
                )
            })?;
        if scores.len() != tokens.len() {
            return Err(invalid(
                "tokenizer.ggml.scores",
                format!("{} scores for {} tokens", scores.len(), tokens.len()),
            ));
        }
        let (bos_default, _, unk_default) = SPM_DEFAULT_IDS;
        let n = tokens.len();
        let VocabJson { vocab, added, normal } = vocab_json(tokens, &types)?;
        // Merges: each normal piece from its splits into two normal pieces, highest score first.
        let mut ranked: Vec<(f32, usize, &str, &str)> = Vec::new();
        for (&piece, &id) in &normal {
            for (at, _) in piece.char_indices().skip(1) {
                let (l, r) = piece.split_at(at);
                if normal.contains_key(l) && normal.contains_key(r) {
                    ranked.push((scores[id], id, l, r));
                }
            }
        }
        ranked.sort_by(|a, b| {
            b.0.total_cmp(&a.0)
                .then(a.1.cmp(&b.1))
                .then(a.2.cmp(b.2))
                .then(a.3.cmp(b.3))
        });
        let merges: Vec<Json> = ranked.iter().map(|m| json!([m.2, m.3])).collect();
        let unk = self.special_id("tokenizer.ggml.unknown_token_id", Some(unk_default), n)?;
        let space = !matches!(
            self.get("tokenizer.ggml.add_space_prefix"),
            Some(Value::Bool(false))
        );
        let add_bos = !matches!(self.get("tokenizer.ggml.add_bos_token"), Some(Value::Bool(false)));
        let bos = self.special_id("tokenizer.ggml.bos_token_id", Some(bos_default), n)?;
        let escape = json!({"type": "Replace", "pattern": {"String": " "}, "content": "\u{2581}"});
        let normalizer = if space {
            json!({"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "\u{2581}"}, escape]})
        } else {
            escape
        };
        let mut decoders = vec![
            json!({"type": "Replace", "pattern": {"String": "\u{2581}"}, "content": " "}),
            json!({"type": "ByteFallback"}),
            json!({"type": "Fuse"}),
        ];
        if space {
            decoders.push(json!({"type": "Strip", "content": " ", "start": 1, "stop": 0}));
        }
        let post = match (add_bos, bos) {
            (true, Some(id)) => bos_in_front(tokens, id),
            _ => Json::Null,
        };
        Ok(json!({
            "version": "1.0",
            "truncation": Json::Null,
            "padding": Json::Null,
            "added_tokens": added,
            "normalizer": normalizer,
            "pre_tokenizer": Json::Null,
            "post_processor": post,
            "decoder": {"type": "Sequence", "decoders": decoders},
            "model": {
                "type": "BPE", "dropout": Json::Null,
                "unk_token": unk.map(|u| tokens[u as usize].clone()),
                "continuing_subword_prefix": Json::Null, "end_of_word_suffix": Json::Null,
                "fuse_unk": true, "byte_fallback": true, "ignore_merges": false,
                "vocab": vocab, "merges": merges,
            },
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A GGUF file written by hand: the key-value pairs (already encoded after their key), the
    /// tensor infos and data.
    struct File {
        version: u32,
        kv: Vec<(String, Vec<u8>)>,
        tensors: Vec<(String, Vec<u64>, u32, u64)>,
        data: Vec<u8>,
        alignment: u64,
    }

    fn string(s: &str) -> Vec<u8> {
        let mut v = (s.len() as u64).to_le_bytes().to_vec();
        v.extend_from_slice(s.as_bytes());
        v
    }

    fn typed(ty: u32, body: &[u8]) -> Vec<u8> {
        let mut v = ty.to_le_bytes().to_vec();
        v.extend_from_slice(body);
        v
    }

    impl File {
        fn new() -> File {
            File {
                version: 3,
                kv: Vec::new(),
                tensors: Vec::new(),
                data: Vec::new(),
                alignment: DEFAULT_ALIGNMENT,
            }
        }

        fn kv(mut self, key: &str, value: Vec<u8>) -> File {
            self.kv.push((key.to_string(), value));
            self
        }

        /// A tensor of `dims` and type `ty`, its bytes counting up, at the next aligned offset.
        fn tensor(mut self, name: &str, dims: &[u64], ty: u32) -> File {
            let t = GgmlType::from_id(ty).unwrap();
            let bytes = dims.iter().product::<u64>() / t.block * t.block_bytes;
            let offset = (self.data.len() as u64).next_multiple_of(self.alignment);
            self.data.resize(offset as usize, 0);
            self.data.extend((0..bytes).map(|i| i as u8));
            self.tensors.push((name.to_string(), dims.to_vec(), ty, offset));
            self
        }

        fn bytes(&self) -> Vec<u8> {
            let mut v = b"GGUF".to_vec();
            v.extend(self.version.to_le_bytes());
            v.extend((self.tensors.len() as u64).to_le_bytes());
            v.extend((self.kv.len() as u64).to_le_bytes());
            for (k, value) in &self.kv {
                v.extend(string(k));
                v.extend(value);
            }
            for (name, dims, ty, offset) in &self.tensors {
                v.extend(string(name));
                v.extend((dims.len() as u32).to_le_bytes());
                for d in dims {
                    v.extend(d.to_le_bytes());
                }
                v.extend(ty.to_le_bytes());
                v.extend(offset.to_le_bytes());
            }
            v.resize((v.len() as u64).next_multiple_of(self.alignment) as usize, 0);
            v.extend(&self.data);
            v
        }
    }

    fn example() -> File {
        let tokens = {
            let mut b = 8u32.to_le_bytes().to_vec();
            b.extend(3u64.to_le_bytes());
            for t in ["a", "bé", "<0x0A>"] {
                b.extend(string(t));
            }
            typed(9, &b)
        };
        File::new()
            .kv("general.architecture", typed(8, &string("qwen3moe")))
            .kv("qwen3moe.block_count", typed(4, &2u32.to_le_bytes()))
            .kv("qwen3moe.rope.freq_base", typed(6, &1e6f32.to_le_bytes()))
            .kv("tokenizer.ggml.tokens", tokens)
            .kv("tokenizer.ggml.add_bos_token", typed(7, &[0]))
            .tensor("token_embd.weight", &[64, 3], 8)
            .tensor("output_norm.weight", &[64], 0)
            .tensor("blk.0.ffn_gate_exps.weight", &[256, 4, 2], 12)
    }

    #[test]
    fn a_file_reads_back_with_its_metadata_and_tensors() {
        let f = example();
        let bytes = f.bytes();
        let g = Gguf::parse(&bytes).unwrap();
        assert_eq!(g.version, 3);
        assert_eq!(g.str("general.architecture").unwrap(), "qwen3moe");
        assert_eq!(g.u64("qwen3moe.block_count").unwrap(), 2);
        assert_eq!(
            g.get("qwen3moe.rope.freq_base").and_then(Value::as_f64),
            Some(1e6)
        );
        let tokens = g.get("tokenizer.ggml.tokens").and_then(Value::as_array).unwrap();
        assert_eq!(tokens.strings().unwrap(), ["a", "bé", "<0x0A>"]);
        assert_eq!(tokens.len(), 3);
        assert!(tokens.ints().is_none());
        assert_eq!(g.get("tokenizer.ggml.add_bos_token"), Some(&Value::Bool(false)));
        assert_eq!(g.keys().count(), 5);
        assert!(g
            .str("qwen3moe.block_count")
            .unwrap_err()
            .to_string()
            .contains("a string expected"));
        assert!(g.u64("nothing").unwrap_err().to_string().contains("missing"));
        assert_eq!(g.tensors.len(), 3);
        let q8 = g.tensor("token_embd.weight").unwrap();
        assert_eq!((q8.ty.name, q8.elem_count(), q8.bytes), ("Q8_0", 192, 6 * 34));
        let k4 = g.tensor("blk.0.ffn_gate_exps.weight").unwrap();
        assert_eq!(
            (k4.ty.name, k4.dims.as_slice(), k4.bytes),
            ("Q4_K", &[256, 4, 2][..], 8 * 144)
        );
        // Each tensor's bytes are where the writer put them.
        for (name, _, _, offset) in &f.tensors {
            let t = g.tensor(name).unwrap();
            assert_eq!(t.start, g.data_start + offset);
            assert_eq!(
                t.data(&bytes),
                &f.data[*offset as usize..(*offset + t.bytes) as usize]
            );
        }
    }

    #[test]
    fn every_truncation_is_an_error() {
        let bytes = example().bytes();
        for n in 0..bytes.len() {
            assert!(
                Gguf::parse(&bytes[..n]).is_err(),
                "{n} of {} bytes read as a file",
                bytes.len()
            );
        }
    }

    /// The error's message for a file changed by `f`.
    fn err(f: impl FnOnce(File) -> File) -> String {
        Gguf::parse(&f(example()).bytes()).unwrap_err().to_string()
    }

    fn with_header(mutate: impl FnOnce(&mut Vec<u8>)) -> String {
        let mut b = example().bytes();
        mutate(&mut b);
        Gguf::parse(&b).unwrap_err().to_string()
    }

    #[test]
    fn malformed_files_are_refused_with_the_cause_named() {
        assert!(with_header(|b| b[0] = b'X').contains("not a GGUF file"));
        assert!(with_header(|b| b[4..8].copy_from_slice(&1u32.to_le_bytes())).contains("version 1"));
        // Counts far past what the file holds, before any allocation.
        assert!(with_header(|b| b[8..16].copy_from_slice(&u64::MAX.to_le_bytes()))
            .contains("tensor infos cannot fit"));
        assert!(
            with_header(|b| b[16..24].copy_from_slice(&(1u64 << 40).to_le_bytes()))
                .contains("pairs cannot fit")
        );
        // A string longer than the file (as long as a u64 counts: the end it needs is told as
        // u64::MAX, not an overflow).
        assert!(err(|f| f.kv("k", typed(8, &u64::MAX.to_le_bytes()))).contains("the file ends"));
        assert!(err(|f| f.kv("k", typed(8, &(u64::MAX - 3).to_le_bytes()))).contains(&u64::MAX.to_string()));
        // An array whose count the file cannot hold.
        let mut huge = 4u32.to_le_bytes().to_vec();
        huge.extend((1u64 << 61).to_le_bytes());
        assert!(err(|f| f.kv("k", typed(9, &huge))).contains("elements of type 4"));
        let mut nested = 9u32.to_le_bytes().to_vec();
        nested.extend(1u64.to_le_bytes());
        nested.extend(typed(4, &1u64.to_le_bytes()));
        assert!(err(|f| f.kv("k", typed(9, &nested))).contains("an array of arrays"));
        assert!(err(|f| f.kv("k", typed(13, &[0]))).contains("unknown value type 13"));
        assert!(err(|f| f.kv("k", typed(7, &[2]))).contains("a bool of byte 2"));
        assert!(err(|f| f.kv("k", typed(8, &[1, 0, 0, 0, 0, 0, 0, 0, 0xff]))).contains("not UTF-8"));
        assert!(err(|f| f.kv("general.architecture", typed(8, &string("x")))).contains("given twice"));
        assert!(err(|f| f.kv("general.alignment", typed(4, &3u32.to_le_bytes()))).contains("a power of two"));
        assert!(
            err(|f| f.kv("general.alignment", typed(10, &32u64.to_le_bytes()))).contains("a power of two")
        );
        // Tensor infos.
        assert!(err(|f| f.tensor("t", &[1, 1, 1, 1, 1], 0)).contains("5 dims"));
        assert!(err(|f| f.tensor("t", &[33], 8)).contains("not whole Q8_0 blocks"));
        assert!(err(|f| f.tensor("token_embd.weight", &[4], 0)).contains("listed twice"));
        let mut f = example();
        f.tensors.push(("t".into(), vec![0], 0, 0));
        assert!(Gguf::parse(&f.bytes())
            .unwrap_err()
            .to_string()
            .contains("no elements"));
        let mut f = example();
        f.tensors.push(("t".into(), vec![1 << 32, 1 << 32], 0, 0));
        assert!(Gguf::parse(&f.bytes())
            .unwrap_err()
            .to_string()
            .contains("too many"));
        let mut f = example();
        f.tensors.push(("t".into(), vec![4], 5, 0));
        assert!(Gguf::parse(&f.bytes())
            .unwrap_err()
            .to_string()
            .contains("unknown tensor type 5"));
        // Offsets: unaligned, past the end, overlapping.
        let mut f = example();
        f.tensors[1].3 += 4;
        assert!(Gguf::parse(&f.bytes())
            .unwrap_err()
            .to_string()
            .contains("not a multiple of the alignment"));
        let mut f = example();
        f.tensors[2].3 = 1 << 20;
        assert!(Gguf::parse(&f.bytes())
            .unwrap_err()
            .to_string()
            .contains("the file ends"));
        let mut f = example();
        f.tensors[2].3 = u64::MAX - 31;
        assert!(Gguf::parse(&f.bytes())
            .unwrap_err()
            .to_string()
            .contains("overflows"));
        let mut f = example();
        f.tensors[1].3 = f.tensors[0].3;
        assert!(Gguf::parse(&f.bytes())
            .unwrap_err()
            .to_string()
            .contains("overlap"));
    }

    #[test]
    fn a_larger_alignment_is_kept() {
        let mut f = File::new();
        f.alignment = 64;
        let f = f
            .kv("general.alignment", typed(4, &64u32.to_le_bytes()))
            .tensor("a", &[3], 0)
            .tensor("b", &[5], 1);
        let bytes = f.bytes();
        let g = Gguf::parse(&bytes).unwrap();
        assert_eq!(g.alignment, 64);
        assert_eq!(g.data_start % 64, 0);
        assert_eq!(g.tensor("b").unwrap().start, g.data_start + 64);
        assert_eq!(g.tensor("b").unwrap().data(&bytes), &f.data[64..74]);
    }
}
