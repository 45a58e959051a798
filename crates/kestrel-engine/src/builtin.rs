//! The built-in model, embedded in the binary so that an installed or copied `kestrel` runs
//! without a checkout: `models/kestrel-tiny` (a 4-layer Qwen3-MoE of 8 M parameters trained by
//! `scripts/fixtures/train-builtin-model.py`; its `RECIPE.md` says how), 16 MB of bf16 weights.

/// How messages name the built-in model.
pub const LABEL: &str = "kestrel-tiny (built in)";

pub const CONFIG: &str = include_str!("../../../models/kestrel-tiny/config.json");
pub const GENERATION: &str = include_str!("../../../models/kestrel-tiny/generation_config.json");
pub const TOKENIZER: &[u8] = include_bytes!("../../../models/kestrel-tiny/tokenizer.json");
pub const TOKENIZER_CONFIG: &str = include_str!("../../../models/kestrel-tiny/tokenizer_config.json");
pub const WEIGHTS: &[u8] = include_bytes!("../../../models/kestrel-tiny/model.safetensors");
