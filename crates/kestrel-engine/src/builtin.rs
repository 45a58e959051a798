//! The built-in model, embedded in the binary so that an installed or copied `kestrel` runs
//! without a checkout: `models/kestrel-tiny` (a 4-layer Qwen3-MoE of 8 M parameters trained by
//! `scripts/fixtures/train-builtin-model.py`; its `RECIPE.md` says how), 16 MB of bf16 weights.

use std::path::Path;

use kestrel_model::{ModelConfig, Weights};
use kestrel_text::{GenerationConfig, TextError, Tokenizer};

use crate::error::Result;
use crate::model::{Model, ModelText};

/// How messages name the built-in model.
pub const LABEL: &str = "kestrel-tiny (built in)";

const CONFIG: &str = include_str!("../../../models/kestrel-tiny/config.json");
const GENERATION: &str = include_str!("../../../models/kestrel-tiny/generation_config.json");
const TOKENIZER: &[u8] = include_bytes!("../../../models/kestrel-tiny/tokenizer.json");
const TOKENIZER_CONFIG: &str = include_str!("../../../models/kestrel-tiny/tokenizer_config.json");
const WEIGHTS: &[u8] = include_bytes!("../../../models/kestrel-tiny/model.safetensors");

/// The built-in model's files, read from the binary.
pub fn open() -> Result<Model> {
    let at = |file: &str| Path::new(LABEL).join(file);
    let generation = GenerationConfig::from_json(GENERATION).map_err(|reason| TextError::File {
        path: at("generation_config.json"),
        reason,
    })?;
    let tokenizer = Tokenizer::from_bytes(
        TOKENIZER,
        Some(TOKENIZER_CONFIG),
        &at("tokenizer.json"),
        &at("tokenizer_config.json"),
    )?;
    Ok(Model {
        label: LABEL.to_string(),
        config: ModelConfig::from_json(CONFIG)?,
        weights: Weights::from_safetensors_bytes(LABEL, WEIGHTS.to_vec())?,
        text: ModelText::new(LABEL, Some(tokenizer), generation)?,
    })
}
