//! Embeddings: each input's hidden states after the final norm, pooled into one vector per input
//! (llama.cpp's `t_embd` and pooling). Every input is its own sequence with its own KV, and all of
//! them advance in ONE pass over the weights.

use crate::kv::{KvCache, KvCodec, PRIVATE_PAGE_ROWS};
use crate::model::forward::{forward_batch, LogitRows, Scratch};
use crate::model::Model;
use crate::{Error, Result};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pooling {
    /// The average over the input's tokens.
    Mean,
    /// The first token's state.
    Cls,
    /// The last token's state (what a causal model has read everything by).
    Last,
}

impl Pooling {
    pub fn from_name(name: &str) -> Result<Pooling> {
        match name {
            "mean" => Ok(Pooling::Mean),
            "cls" => Ok(Pooling::Cls),
            "last" => Ok(Pooling::Last),
            _ => Err(Error::InvalidArgument(format!("unknown pooling {name:?} (use mean, cls or last)"))),
        }
    }
}

/// One vector of `dim` values per input, L2-normalized when `normalize`.
pub fn embed(m: &Model, inputs: &[&[u32]], pooling: Pooling, normalize: bool) -> Result<Vec<Vec<f32>>> {
    if inputs.is_empty() {
        return Err(Error::InvalidArgument("embeddings need at least one input".into()));
    }
    if let Some(i) = inputs.iter().position(|t| t.is_empty()) {
        return Err(Error::InvalidArgument(format!("input {i} has no tokens; every input needs at least one")));
    }
    let geo = m.kv_geometry(PRIVATE_PAGE_ROWS, KvCodec::F16);
    let mut kvs: Vec<KvCache> = inputs.iter().map(|_| KvCache::private(geo.clone(), m.rt.pages())).collect();
    let mut refs: Vec<&mut KvCache> = kvs.iter_mut().collect();
    let counts: Vec<usize> = inputs.iter().map(|t| t.len()).collect();
    let tokens: Vec<u32> = inputs.concat();
    let mut hidden = Vec::new();
    forward_batch(m, &mut refs, &counts, &tokens, LogitRows::Hidden, &mut Scratch::new(), &mut hidden, None)?;
    let d = m.config.dim;
    let mut out = Vec::with_capacity(inputs.len());
    let mut at = 0;
    for &n in &counts {
        let rows = &hidden[at * d..(at + n) * d];
        at += n;
        let mut v: Vec<f32> = match pooling {
            Pooling::Cls => rows[..d].to_vec(),
            Pooling::Last => rows[(n - 1) * d..].to_vec(),
            Pooling::Mean => {
                // Summed in f64: a long input's average does not depend on rounding order.
                let mut acc = vec![0.0f64; d];
                for r in rows.chunks_exact(d) {
                    acc.iter_mut().zip(r).for_each(|(a, &x)| *a += x as f64);
                }
                acc.iter().map(|&a| (a / n as f64) as f32).collect()
            }
        };
        if normalize {
            let norm = v.iter().map(|&x| (x as f64) * (x as f64)).sum::<f64>().sqrt();
            if norm > 0.0 {
                v.iter_mut().for_each(|x| *x = (*x as f64 / norm) as f32);
            }
        }
        out.push(v);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::Pooling;

    #[test]
    fn pooling_names() {
        assert_eq!(Pooling::from_name("mean").unwrap(), Pooling::Mean);
        assert_eq!(Pooling::from_name("last").unwrap(), Pooling::Last);
        assert!(Pooling::from_name("max").unwrap_err().to_string().contains("mean, cls or last"));
    }
}
