//! Tokenizers read from the GGUF vocabulary: byte-level BPE (`tokenizer.ggml.model = gpt2`) with
//! the pre-tokenizer `tokenizer.ggml.pre` names, Gemma 4's SPM-style BPE (`gemma4`), and
//! SentencePiece (`llama`). Special tokens are
//! split out first, as llama.cpp does; control tokens only when asked to parse them.

mod bpe;
mod spm;

use crate::{Error, Result};
use std::collections::HashMap;

pub const TYPE_NORMAL: i32 = 1;
pub const TYPE_UNKNOWN: i32 = 2;
pub const TYPE_CONTROL: i32 = 3;
pub const TYPE_USER_DEFINED: i32 = 4;
pub const TYPE_BYTE: i32 = 6;

pub struct Vocab {
    pub tokens: Vec<String>,
    pub types: Vec<i32>,
    pub scores: Vec<f32>,
    pub merges: Vec<String>,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    /// End-of-turn / end-of-generation ids besides eos (e.g. `<|im_end|>`, `<end_of_turn>`).
    pub eog: Vec<u32>,
    pub add_bos: bool,
    pub add_space_prefix: bool,
}

enum Kind {
    Bpe(Box<bpe::Bpe>),
    Spm,
}

pub struct Tokenizer {
    kind: Kind,
    vocab: Vocab,
    by_text: HashMap<String, u32>,
    /// Control, user-defined and unknown tokens, longest text first.
    specials: Vec<u32>,
    /// Control tokens whose text a reply shows even without `special`: Gemma 4's thought channel
    /// markers, so the reply's reader can split the thought off (see `VISIBLE_GEMMA4`), and the
    /// tool-call markers (`VISIBLE_CALLS`).
    visible: Vec<u32>,
}

/// Gemma 4 writes its thought as `<|channel>thought\n...<channel|>`; files mark the two markers
/// control or user-defined, and llama.cpp's server keeps them in the text it parses.
const VISIBLE_GEMMA4: [&str; 2] = ["<|channel>", "<channel|>"];

/// The tokens a tool call is written with, in the families that write calls with control
/// tokens (Llama 3.x, Mistral, Gemma 4, DeepSeek): shown, so the server's call parsers read the
/// call from the reply's text (llama.cpp's server keeps them as its chat formats' preserved tokens).
const VISIBLE_CALLS: [&str; 12] = [
    "<|python_tag|>",
    "[TOOL_CALLS]",
    "[ARGS]",
    "[CALL_ID]",
    "<|tool_call>",
    "<tool_call|>",
    "<|\"|>",
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁calls▁end｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁sep｜>",
];

enum Frag<'a> {
    Text(&'a str),
    Token(u32),
}

impl Tokenizer {
    pub fn new(model: &str, pre: &str, vocab: Vocab) -> Result<Self> {
        let n = vocab.tokens.len();
        if vocab.types.len() != n || (!vocab.scores.is_empty() && vocab.scores.len() != n) {
            return Err(Error::Gguf("tokenizer arrays (tokens, token_type, scores) have different lengths".into()));
        }
        let mut by_text = HashMap::with_capacity(n);
        for (i, t) in vocab.tokens.iter().enumerate() {
            by_text.entry(t.clone()).or_insert(i as u32);
        }
        let kind = match model {
            "gpt2" => Kind::Bpe(Box::new(bpe::Bpe::new(pre, &vocab, &by_text)?)),
            "gemma4" => Kind::Bpe(Box::new(bpe::Bpe::new_spm_style(&vocab, &by_text))),
            "llama" => Kind::Spm,
            other => {
                return Err(Error::UnsupportedModel(format!(
                    "tokenizer model '{other}' is not supported (supported: gpt2 byte-level BPE, gemma4 SPM-style BPE, llama SentencePiece)"
                )))
            }
        };
        let gemma4: &[&str] = if model == "gemma4" { &VISIBLE_GEMMA4 } else { &[] };
        let visible = gemma4.iter().chain(&VISIBLE_CALLS).filter_map(|t| by_text.get(*t).copied()).collect();
        let mut specials: Vec<u32> = (0..n as u32)
            .filter(|&i| matches!(vocab.types[i as usize], TYPE_CONTROL | TYPE_USER_DEFINED | TYPE_UNKNOWN) && !vocab.tokens[i as usize].is_empty())
            .collect();
        specials.sort_by_key(|&i| std::cmp::Reverse(vocab.tokens[i as usize].len()));
        Ok(Tokenizer { kind, vocab, by_text, specials, visible })
    }

    pub fn n_vocab(&self) -> usize {
        self.vocab.tokens.len()
    }
    pub fn bos(&self) -> Option<u32> {
        self.vocab.bos
    }
    pub fn eos(&self) -> Option<u32> {
        self.vocab.eos
    }
    pub fn add_bos_default(&self) -> bool {
        self.vocab.add_bos
    }
    pub fn token_type(&self, id: u32) -> i32 {
        self.vocab.types[id as usize]
    }
    pub fn token_text(&self, id: u32) -> &str {
        &self.vocab.tokens[id as usize]
    }

    /// True for tokens that end generation: eos, and the end-of-turn ids the vocabulary declares.
    /// Where `other` reads ids differently from this tokenizer (None when it does not): a draft
    /// model's tokens must mean the target's.
    pub fn vocab_difference(&self, other: &Tokenizer) -> Option<String> {
        let (a, b) = (&self.vocab.tokens, &other.vocab.tokens);
        if a.len() != b.len() {
            return Some(format!("the vocabularies have {} and {} tokens", a.len(), b.len()));
        }
        let i = (0..a.len()).find(|&i| a[i] != b[i])?;
        Some(format!("token {i} is {:?} in one vocabulary and {:?} in the other", a[i], b[i]))
    }

    pub fn is_eog(&self, id: u32) -> bool {
        Some(id) == self.vocab.eos || self.vocab.eog.contains(&id)
    }

    pub fn eog_ids(&self) -> Vec<u32> {
        self.vocab.eos.into_iter().chain(self.vocab.eog.iter().copied()).collect()
    }

    pub fn lookup(&self, text: &str) -> Option<u32> {
        self.by_text.get(text).copied()
    }

    /// Split `text` around special tokens; control (and unknown) tokens only when `parse_special`.
    fn partition<'a>(&self, text: &'a str, parse_special: bool) -> Vec<Frag<'a>> {
        let mut frags = vec![Frag::Text(text)];
        for &id in &self.specials {
            let ty = self.vocab.types[id as usize];
            if !parse_special && (ty == TYPE_CONTROL || ty == TYPE_UNKNOWN) {
                continue;
            }
            let pat = self.vocab.tokens[id as usize].as_str();
            if !frags.iter().any(|f| matches!(f, Frag::Text(t) if t.contains(pat))) {
                continue;
            }
            let mut next = Vec::with_capacity(frags.len() + 2);
            for f in frags {
                match f {
                    Frag::Text(t) => {
                        let mut rest = t;
                        while let Some(at) = rest.find(pat) {
                            if at > 0 {
                                next.push(Frag::Text(&rest[..at]));
                            }
                            next.push(Frag::Token(id));
                            rest = &rest[at + pat.len()..];
                        }
                        if !rest.is_empty() {
                            next.push(Frag::Text(rest));
                        }
                    }
                    tok => next.push(tok),
                }
            }
            frags = next;
        }
        frags
    }

    /// Text to ids. `add_bos`: None uses the model's own default (`tokenizer.ggml.add_bos_token`).
    pub fn encode(&self, text: &str, add_bos: Option<bool>, parse_special: bool) -> Vec<u32> {
        let mut out = Vec::new();
        if add_bos.unwrap_or(self.vocab.add_bos) {
            if let Some(b) = self.vocab.bos {
                out.push(b);
            }
        }
        let mut prev_special = true;
        for f in self.partition(text, parse_special) {
            match f {
                Frag::Token(id) => {
                    out.push(id);
                    prev_special = true;
                }
                Frag::Text(t) => {
                    match &self.kind {
                        Kind::Bpe(b) => b.encode(t, self, &mut out),
                        Kind::Spm => {
                            let mut s = String::with_capacity(t.len() + 3);
                            if self.vocab.add_space_prefix && prev_special {
                                s.push(' ');
                            }
                            s.push_str(t);
                            spm::encode(&s.replace(' ', "\u{2581}"), self, &mut out);
                        }
                    }
                    prev_special = false;
                }
            }
        }
        out
    }

    /// The bytes one token stands for. Control tokens are empty unless `special`.
    pub fn piece(&self, id: u32, special: bool) -> Vec<u8> {
        let Some(text) = self.vocab.tokens.get(id as usize) else { return Vec::new() };
        match self.vocab.types[id as usize] {
            TYPE_CONTROL => {
                if special || self.visible.contains(&id) {
                    text.as_bytes().to_vec()
                } else {
                    Vec::new()
                }
            }
            TYPE_UNKNOWN => "\u{2585}".as_bytes().to_vec(),
            TYPE_BYTE => spm::byte_of(text).map(|b| vec![b]).unwrap_or_default(),
            ty => match &self.kind {
                Kind::Bpe(b) if ty != TYPE_USER_DEFINED => b.decode_piece(text),
                Kind::Bpe(_) => text.as_bytes().to_vec(),
                Kind::Spm => text.replace('\u{2581}', " ").into_bytes(),
            },
        }
    }

    pub fn decode(&self, ids: &[u32], special: bool) -> Vec<u8> {
        let mut out = Vec::new();
        for (i, &id) in ids.iter().enumerate() {
            let p = self.piece(id, special);
            // SentencePiece marks word starts with a space; the first one is the prefix we added.
            if i == 0 && matches!(self.kind, Kind::Spm) && self.vocab.add_space_prefix && p.first() == Some(&b' ') {
                out.extend_from_slice(&p[1..]);
            } else {
                out.extend_from_slice(&p);
            }
        }
        out
    }
}

/// Streaming detokenizer: emits only complete UTF-8 characters, holding back a partial tail.
#[derive(Default)]
pub struct Utf8Stream {
    pending: Vec<u8>,
}

/// A `Utf8Stream`'s state, without an allocation.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Utf8Mark {
    bytes: [u8; 4],
    len: u8,
}

impl Utf8Stream {
    pub fn push(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let valid = match std::str::from_utf8(&self.pending) {
            Ok(_) => self.pending.len(),
            Err(e) => match e.error_len() {
                // An invalid sequence (not just an unfinished one) is replaced, not held forever.
                Some(_) => {
                    let s = String::from_utf8_lossy(&self.pending).into_owned();
                    self.pending.clear();
                    return s;
                }
                None => e.valid_up_to(),
            },
        };
        let rest = self.pending.split_off(valid);
        String::from_utf8(std::mem::replace(&mut self.pending, rest)).expect("validated above")
    }

    /// The bytes held back (at most three: an unfinished character), to restore later.
    pub fn mark(&self) -> Utf8Mark {
        let mut m = Utf8Mark::default();
        let n = self.pending.len().min(m.bytes.len());
        m.bytes[..n].copy_from_slice(&self.pending[..n]);
        m.len = n as u8;
        m
    }

    pub fn restore(&mut self, m: Utf8Mark) {
        self.pending.clear();
        self.pending.extend_from_slice(&m.bytes[..m.len as usize]);
    }

    /// Whatever is left at the end, replacement characters for an unfinished sequence.
    pub fn finish(&mut self) -> String {
        let s = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        s
    }
}

#[cfg(test)]
mod tests {
    use super::Utf8Stream;

    #[test]
    fn utf8_stream_never_splits_a_character() {
        let text = "héllo — 世界 🙂";
        let mut s = Utf8Stream::default();
        let mut got = String::new();
        for b in text.as_bytes() {
            let piece = s.push(&[*b]);
            assert!(!piece.contains('\u{FFFD}'));
            got.push_str(&piece);
        }
        got.push_str(&s.finish());
        assert_eq!(got, text);
    }
}
