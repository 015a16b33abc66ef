//! Constrained decoding (structured output) with llguidance, the library llama.cpp and vLLM use:
//! a request's grammar (Lark, which may embed JSON schemas as `%json { ... }`, or llguidance's
//! JSON grammar list) becomes a matcher that says, before each sampled token, which tokens may
//! follow. The scheduler masks the stream's logits with it and advances it over emitted tokens.
//!
//! The matcher sees tokens as the bytes they stand for (a trie built from the vocabulary's pieces);
//! control tokens carry llguidance's special marker, so no grammar text can match them, and the
//! end-of-generation tokens are allowed exactly where the grammar may end.

use crate::tokenizer::Tokenizer;
use crate::{Error, Result};
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, SimpleVob, TokEnv, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory};
use std::sync::Arc;

/// What every grammar of one model shares: its token trie and the compiled lexer slices.
pub struct GrammarEnv {
    factory: ParserFactory,
}

impl GrammarEnv {
    pub fn new(tok: &Tokenizer) -> Result<Self> {
        let n = tok.n_vocab();
        let words: Vec<Vec<u8>> = (0..n as u32)
            .map(|id| {
                let piece = tok.piece(id, false);
                if piece.is_empty() || tok.token_type(id) == crate::tokenizer::TYPE_CONTROL {
                    // Special: reachable by a grammar's `<|name|>` token syntax only.
                    let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                    let text = tok.token_text(id);
                    w.extend_from_slice(if text.is_empty() { format!("<[{id}]>").into_bytes() } else { text.as_bytes().to_vec() }.as_slice());
                    w
                } else {
                    piece
                }
            })
            .collect();
        let eog = tok.eog_ids();
        let Some(&eos) = eog.first() else {
            return Err(Error::UnsupportedModel("constrained decoding needs an end-of-generation token, and this vocabulary declares none".into()));
        };
        let info = TokRxInfo::new(n as u32, eos);
        let trie = TokTrie::from(&info, &words).with_eos_tokens(&eog);
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(trie));
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| Error::Internal(format!("llguidance could not index this vocabulary: {e}")))?;
        factory.quiet();
        Ok(GrammarEnv { factory })
    }

    /// Compile `grammar`: Lark text, or (starting with `{`) llguidance's JSON grammar list.
    pub fn compile(&self, grammar: &str) -> Result<Constraint> {
        let bad = |e: String| Error::InvalidArgument(format!("the grammar does not compile: {e}"));
        let top = TopLevelGrammar::from_lark_or_grammar_list(grammar).map_err(|e| bad(e.to_string()))?;
        let parser = self.factory.create_parser(top).map_err(|e| bad(e.to_string()))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(bad(e));
        }
        Ok(Constraint { matcher, mask: None })
    }
}

/// One stream's grammar state.
pub struct Constraint {
    matcher: Matcher,
    /// The mask for the next token, computed once per position.
    mask: Option<SimpleVob>,
}

impl Constraint {
    /// Set every logit the grammar forbids next to -inf. Fails if the grammar allows nothing (a
    /// matcher in error).
    pub fn mask(&mut self, logits: &mut [f32]) -> Result<()> {
        if self.mask.is_none() {
            let m = self.matcher.compute_mask().map_err(|e| Error::InvalidArgument(format!("the grammar failed: {e}")))?;
            self.mask = Some(m);
        }
        let mask = self.mask.as_ref().expect("computed above");
        let n = mask.len().min(logits.len());
        let mut any = false;
        for (i, l) in logits[..n].iter_mut().enumerate() {
            if mask.get(i) {
                any = true;
            } else {
                *l = f32::NEG_INFINITY;
            }
        }
        logits[n..].fill(f32::NEG_INFINITY);
        if !any {
            return Err(Error::InvalidArgument("the grammar allows no token here".into()));
        }
        Ok(())
    }

    /// Advance over an emitted token; true when the grammar is complete (nothing may follow).
    pub fn advance(&mut self, tok: u32) -> Result<bool> {
        self.mask = None;
        self.matcher.consume_token(tok).map_err(|e| Error::InvalidArgument(format!("the grammar refused token {tok}: {e}")))?;
        Ok(self.matcher.is_stopped())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::Vocab;

    /// A byte-level vocabulary: every byte is a token, plus an end token.
    fn bytes_tokenizer() -> Tokenizer {
        let mut tokens: Vec<String> = (0..=255u8).map(|b| format!("<0x{b:02X}>")).collect();
        tokens.push("</s>".into());
        let mut types = vec![crate::tokenizer::TYPE_BYTE; 256];
        types.push(crate::tokenizer::TYPE_CONTROL);
        let vocab =
            Vocab { tokens, types, scores: vec![0.0; 257], merges: vec![], bos: None, eos: Some(256), eog: vec![], add_bos: false, add_space_prefix: false };
        Tokenizer::new("llama", "default", vocab).expect("a byte vocabulary")
    }

    #[test]
    fn a_json_schema_forces_its_shape_and_ends() {
        let env = GrammarEnv::new(&bytes_tokenizer()).unwrap();
        let mut c = env.compile(r#"start: %json {"type":"object","properties":{"a":{"enum":["x"]}},"required":["a"],"additionalProperties":false}"#).unwrap();
        let want = br#"{"a": "x"}"#;
        let mut done = false;
        for &b in want.iter() {
            let mut logits = vec![0.0f32; 257];
            c.mask(&mut logits).unwrap();
            assert!(logits[b as usize].is_finite(), "byte {:?} refused", b as char);
            assert!(logits[b'z' as usize].is_infinite());
            done = c.advance(b as u32).unwrap();
        }
        // Complete: only the end token remains, or the matcher has stopped.
        if !done {
            let mut logits = vec![0.0f32; 257];
            c.mask(&mut logits).unwrap();
            assert!(logits[256].is_finite());
            assert_eq!(logits.iter().filter(|l| l.is_finite()).count(), 1);
        }
    }

    #[test]
    fn a_bad_grammar_is_an_invalid_argument() {
        let env = GrammarEnv::new(&bytes_tokenizer()).unwrap();
        assert!(matches!(env.compile(r#"start: %json {"type":"nonsense"}"#), Err(Error::InvalidArgument(_))));
        assert!(matches!(env.compile("start: foo"), Err(Error::InvalidArgument(_))));
    }
}
