//! Fuzz target: `config.json` (`ModelConfig::from_json`), then, for a config that parses, the
//! figures `kestrel inspect` derives from the config alone: MoE layers, the footprint of no
//! weights, the quantisation format of a few modules and the rotary table.

#![no_main]

use kestrel_core::rope::RopeTable;
use kestrel_model::{footprint, ModelConfig, Weights};
use libfuzzer_sys::fuzz_target;

/// Module paths whose quantisation format is asked for.
const MODULES: [&str; 4] = [
    "model.embed_tokens",
    "model.layers.0.mlp.gate",
    "model.layers.0.self_attn.q_proj",
    "lm_head",
];

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(config) = ModelConfig::from_json(text) else {
        return;
    };
    let mut sum = config.moe_layers();
    assert_eq!(config.layer_kinds.len(), config.layers);
    assert_eq!(config.mlp_kinds.len(), config.layers);
    let none = Weights::from_memory("fuzz", Vec::new()).expect("no tensors are valid weights");
    if let Ok(f) = footprint(&config, &none) {
        sum = sum.wrapping_add(f.params as usize);
    }
    if let Some(quant) = &config.quant {
        for module in MODULES {
            sum = sum.wrapping_add(quant.format_for(module).map_or(0, |f| f.bits as usize));
        }
    }
    let table = RopeTable::new(
        config.rope.theta,
        config.head_dim,
        config.rope.partial_rotary_factor,
        &config.rope.scaling,
    );
    sum = sum.wrapping_add(table.inv_freq.len() + table.rot_dim);
    std::hint::black_box(sum);
});
