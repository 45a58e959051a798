//! The GGUF reader against llama.cpp's own Python writer and reader (`gguf` on PyPI): the
//! fixture `tests/gguf/reader.gguf` (made by `scripts/gguf/make-reader-fixture.py`) holds
//! metadata of every value type, a custom alignment and tensors of seven ggml types; every key's
//! type and value, every tensor's dims, type, place and bytes (CRC-32) equal what `GGUFReader`
//! found (`reader.json`).

use kestrel_model::gguf::{Array, Gguf, Value};
use serde_json::Value as Json;

fn crc32(bytes: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in bytes {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = (crc >> 1) ^ (0xEDB8_8320 & (crc & 1).wrapping_neg());
        }
    }
    !crc
}

/// The value as the fixture's JSON writes it: its type name and value.
fn as_json(v: &Value) -> (String, Json) {
    let array = |a: &Array| -> (&str, Json) {
        match a {
            Array::U8(v) => ("UINT8", v.clone().into()),
            Array::I8(v) => ("INT8", v.clone().into()),
            Array::U16(v) => ("UINT16", v.clone().into()),
            Array::I16(v) => ("INT16", v.clone().into()),
            Array::U32(v) => ("UINT32", v.clone().into()),
            Array::I32(v) => ("INT32", v.clone().into()),
            Array::U64(v) => ("UINT64", v.clone().into()),
            Array::I64(v) => ("INT64", v.clone().into()),
            Array::F32(v) => (
                "FLOAT32",
                v.iter().map(|&x| f64::from(x)).collect::<Vec<_>>().into(),
            ),
            Array::F64(v) => ("FLOAT64", v.clone().into()),
            Array::Bool(v) => ("BOOL", v.clone().into()),
            Array::String(v) => ("STRING", v.clone().into()),
        }
    };
    let (t, j): (&str, Json) = match v {
        Value::U8(x) => ("UINT8", (*x).into()),
        Value::I8(x) => ("INT8", (*x).into()),
        Value::U16(x) => ("UINT16", (*x).into()),
        Value::I16(x) => ("INT16", (*x).into()),
        Value::U32(x) => ("UINT32", (*x).into()),
        Value::I32(x) => ("INT32", (*x).into()),
        Value::U64(x) => ("UINT64", (*x).into()),
        Value::I64(x) => ("INT64", (*x).into()),
        Value::F32(x) => ("FLOAT32", f64::from(*x).into()),
        Value::F64(x) => ("FLOAT64", (*x).into()),
        Value::Bool(x) => ("BOOL", (*x).into()),
        Value::String(x) => ("STRING", x.clone().into()),
        Value::Array(a) => {
            let (t, j) = array(a);
            return (format!("ARRAY:{t}"), j);
        }
    };
    (t.to_string(), j)
}

#[test]
fn the_reader_finds_what_llama_cpps_reader_finds() {
    let dir = kestrel_testing::fixtures::path("crates/kestrel-model/tests/gguf");
    let bytes = std::fs::read(dir.join("reader.gguf")).unwrap();
    let want: Json =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reader.json")).unwrap()).unwrap();
    let g = Gguf::parse(&bytes).unwrap();
    assert_eq!(g.alignment, want["alignment"].as_u64().unwrap());
    assert_eq!(g.data_start, want["data_start"].as_u64().unwrap());
    let meta = want["metadata"].as_object().unwrap();
    assert_eq!(
        g.keys().collect::<Vec<_>>(),
        meta.keys().map(String::as_str).collect::<Vec<_>>()
    );
    for (key, w) in meta {
        let (t, j) = as_json(g.get(key).unwrap());
        assert_eq!(t, w["type"].as_str().unwrap(), "{key}");
        assert_eq!(j, w["value"], "{key}");
    }
    let tensors = want["tensors"].as_array().unwrap();
    assert_eq!(g.tensors.len(), tensors.len());
    for (t, w) in g.tensors.iter().zip(tensors) {
        assert_eq!(t.name, w["name"].as_str().unwrap());
        let dims: Vec<u64> = w["dims"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d.as_u64().unwrap())
            .collect();
        assert_eq!(t.dims, dims, "{}", t.name);
        assert_eq!(t.ty.name, w["type"].as_str().unwrap(), "{}", t.name);
        assert_eq!(
            t.start - g.data_start,
            w["data_offset"].as_u64().unwrap(),
            "{}",
            t.name
        );
        assert_eq!(t.bytes, w["bytes"].as_u64().unwrap(), "{}", t.name);
        assert_eq!(
            u64::from(crc32(t.data(&bytes))),
            w["crc32"].as_u64().unwrap(),
            "{}",
            t.name
        );
    }
}
