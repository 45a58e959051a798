//! Fuzz target: a GGUF file's header, metadata and tensor infos (`Gguf::parse`, every count,
//! length and offset checked against the bytes), then every key's value looked at through the
//! typed getters, every tensor's bytes read, and the tokenizer built as a `tokenizer.json` value
//! where the metadata holds one; then the file read as a model (`gguf_from_bytes`: the metadata
//! as a config, every tensor mapped, dequantised and reordered) and each of its tensors looked
//! up.

#![no_main]

use kestrel_model::gguf::{Gguf, Value};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(g) = Gguf::parse(data) else {
        return;
    };
    let mut sum = g.alignment.wrapping_add(g.data_start);
    for key in g.keys() {
        let v = g.get(key).expect("every key listed has a value");
        sum = sum.wrapping_add(v.as_u64().unwrap_or(0));
        if let Some(a) = v.as_array() {
            sum = sum.wrapping_add(a.len() as u64);
            sum = sum.wrapping_add(a.ints().map_or(0, |v| v.len() as u64));
            sum = sum.wrapping_add(a.floats().map_or(0, |v| v.len() as u64));
            sum = sum.wrapping_add(a.strings().map_or(0, |v| v.len() as u64));
        }
        let _ = (g.u64(key), g.str(key), v.as_f64(), matches!(v, Value::Bool(true)));
    }
    for t in &g.tensors {
        assert!(g.tensor(&t.name).is_some());
        let bytes = t.data(data);
        assert_eq!(bytes.len() as u64, t.bytes);
        // The first and the last byte: a range past the input shows up under ASan.
        if let (Some(first), Some(last)) = (bytes.first(), bytes.last()) {
            sum = sum.wrapping_add(u64::from(*first) + u64::from(*last));
        }
        sum = sum.wrapping_add(t.elem_count()).wrapping_add(t.dims.len() as u64);
    }
    if let Ok(json) = g.tokenizer_json() {
        sum = sum.wrapping_add(json["model"]["vocab"].as_object().map_or(0, |v| v.len() as u64));
    }
    if let Ok(m) = kestrel_model::gguf_from_bytes(std::path::Path::new("fuzz.gguf"), data.to_vec()) {
        sum = sum.wrapping_add(m.config.layers as u64);
        for name in m.weights.names() {
            let t = m.weights.get(name).expect("a listed tensor reads");
            assert_eq!(t.bytes.len(), t.elem_count() * t.dtype.size_in_bytes());
        }
    }
    std::hint::black_box(sum);
});
