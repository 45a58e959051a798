//! Fuzz target: a safetensors file read from memory (`Weights::from_safetensors_bytes`, the path
//! the built-in model's weights take), then every tensor it lists looked up and its bytes read.

#![no_main]

use kestrel_model::Weights;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(weights) = Weights::from_safetensors_bytes("fuzz", data.to_vec()) else {
        return;
    };
    let mut sum = weights.total_bytes();
    for name in weights.names() {
        let Ok(tensor) = weights.get(name) else {
            continue;
        };
        // Read the first and the last byte: a range past the buffer shows up under ASan even
        // where a slice check would not.
        sum = sum
            .wrapping_add(tensor.elem_count())
            .wrapping_add(tensor.shape.len())
            .wrapping_add(tensor.dtype.size_in_bytes());
        if let (Some(first), Some(last)) = (tensor.bytes.first(), tensor.bytes.last()) {
            sum = sum.wrapping_add(usize::from(*first) + usize::from(*last));
        }
        // Held in memory: no file span.
        assert!(weights.file_span(name).is_none());
    }
    std::hint::black_box(sum);
});
