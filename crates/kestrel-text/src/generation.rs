//! `generation_config.json`: the end-of-sequence ids and the sampling defaults a model ships,
//! which command-line flags override.

use std::path::Path;

use serde_json::Value;

use crate::error::{Result, TextError};
use crate::sample::SamplingParams;

/// transformers' `GenerationConfig.top_k` when a file does not set it.
const TRANSFORMERS_TOP_K: usize = 50;

#[derive(Debug, Clone, Default, PartialEq)]
pub struct GenerationConfig {
    /// Tokens that end generation (`eos_token_id`: one id or a list).
    pub eos_token_ids: Vec<u32>,
    pub bos_token_id: Option<u32>,
    /// `do_sample: false` means greedy whatever the temperature says.
    pub do_sample: Option<bool>,
    pub temperature: Option<f32>,
    pub top_k: Option<usize>,
    pub top_p: Option<f32>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
}

fn ids(v: Option<&Value>) -> Vec<u32> {
    match v {
        Some(Value::Number(n)) => n.as_u64().map(|n| vec![n as u32]).unwrap_or_default(),
        Some(Value::Array(a)) => a.iter().filter_map(|x| x.as_u64().map(|n| n as u32)).collect(),
        _ => Vec::new(),
    }
}

impl GenerationConfig {
    /// Reads `dir/generation_config.json`; a directory without one has no defaults.
    pub fn from_dir(dir: &Path) -> Result<GenerationConfig> {
        let path = dir.join("generation_config.json");
        if !path.exists() {
            return Ok(GenerationConfig::default());
        }
        let text = std::fs::read_to_string(&path).map_err(|error| TextError::Io {
            path: path.clone(),
            error,
        })?;
        GenerationConfig::from_json(&text).map_err(|reason| TextError::File { path, reason })
    }

    pub fn from_json(text: &str) -> std::result::Result<GenerationConfig, String> {
        let v: Value = serde_json::from_str(text).map_err(|e| format!("not valid JSON: {e}"))?;
        let f = |k: &str| v.get(k).and_then(Value::as_f64).map(|x| x as f32);
        let g = GenerationConfig {
            eos_token_ids: ids(v.get("eos_token_id")),
            bos_token_id: ids(v.get("bos_token_id")).first().copied(),
            do_sample: v.get("do_sample").and_then(Value::as_bool),
            temperature: f("temperature"),
            top_k: v.get("top_k").and_then(Value::as_u64).map(|k| k as usize),
            top_p: f("top_p"),
            min_p: f("min_p"),
            repetition_penalty: f("repetition_penalty"),
        };
        // Every value the file sets must be usable, whether or not sampling is on: an error
        // names the file (from `from_dir`) rather than surfacing later as a flag's.
        let d = SamplingParams::default();
        SamplingParams {
            temperature: g.temperature.unwrap_or(d.temperature),
            top_p: g.top_p.unwrap_or(d.top_p),
            min_p: g.min_p.unwrap_or(d.min_p),
            repetition_penalty: g.repetition_penalty.unwrap_or(d.repetition_penalty),
            ..d
        }
        .validate()?;
        Ok(g)
    }

    /// The model's sampling defaults as parameters, with transformers' defaults for what the file
    /// leaves out: sampling only with `do_sample: true` (else greedy, temperature 0), and then
    /// top-k 50 unless the file says otherwise.
    pub fn sampling(&self) -> SamplingParams {
        let d = SamplingParams::default();
        SamplingParams {
            temperature: if self.do_sample == Some(true) {
                self.temperature.unwrap_or(d.temperature)
            } else {
                0.0
            },
            top_k: self.top_k.unwrap_or(TRANSFORMERS_TOP_K),
            top_p: self.top_p.unwrap_or(d.top_p),
            min_p: self.min_p.unwrap_or(d.min_p),
            repetition_penalty: self.repetition_penalty.unwrap_or(d.repetition_penalty),
            ..d
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn published_forms() {
        // Qwen3's.
        let q = GenerationConfig::from_json(
            r#"{"bos_token_id": 151643, "do_sample": true, "eos_token_id": [151645, 151643],
               "pad_token_id": 151643, "temperature": 0.6, "top_k": 20, "top_p": 0.95}"#,
        )
        .unwrap();
        assert_eq!(q.eos_token_ids, [151645, 151643]);
        let s = q.sampling();
        assert_eq!((s.temperature, s.top_k, s.top_p), (0.6, 20, 0.95));
        // One id, and greedy by default.
        let g = GenerationConfig::from_json(r#"{"eos_token_id": 2, "do_sample": false, "temperature": 0.9}"#)
            .unwrap();
        assert_eq!(g.eos_token_ids, [2]);
        assert_eq!(g.sampling().temperature, 0.0);
        // No do_sample: greedy, as transformers decodes.
        let n = GenerationConfig::from_json(r#"{"temperature": 0.7}"#).unwrap();
        assert_eq!(n.sampling().temperature, 0.0);
        // Sampling without a top_k: transformers' 50.
        let t = GenerationConfig::from_json(r#"{"do_sample": true, "top_p": 0.9}"#).unwrap();
        assert_eq!((t.sampling().top_k, t.sampling().top_p), (50, 0.9));
        assert!(GenerationConfig::from_json("{").is_err());
    }

    #[test]
    fn values_out_of_range_are_refused_with_the_range() {
        for (json, what) in [
            (r#"{"temperature": -5}"#, "temperature -5"),
            (r#"{"do_sample": true, "top_p": 0}"#, "top-p 0"),
            (r#"{"min_p": 1.5}"#, "min-p 1.5"),
            (r#"{"repetition_penalty": 0}"#, "repetition penalty 0"),
        ] {
            let e = GenerationConfig::from_json(json).unwrap_err();
            assert!(e.contains(what) && e.contains("out of range:"), "{json}: {e}");
        }
    }

    #[test]
    fn a_bad_file_is_named() {
        let dir = std::env::temp_dir().join(format!("kestrel-genconf-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("generation_config.json"), r#"{"temperature": -5}"#).unwrap();
        let e = GenerationConfig::from_dir(&dir).unwrap_err().to_string();
        let _ = std::fs::remove_dir_all(&dir);
        assert!(
            e.contains("generation_config.json") && e.contains("temperature -5"),
            "{e}"
        );
    }
}
