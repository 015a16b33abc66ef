//! Byte-level BPE (GPT-2 family): split with the pre-tokenizer's regexes, map bytes to the
//! GPT-2 printable alphabet, then apply merges lowest rank first, leftmost on ties.

use super::{Tokenizer, Vocab};
use crate::{Error, Result};
use fancy_regex::Regex;
use std::collections::HashMap;

/// llama.cpp's regex lists per `tokenizer.ggml.pre`; each regex splits the pieces of the one before.
fn pre_regexes(pre: &str) -> Option<(&'static [&'static str], bool)> {
    const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";
    const LLAMA3: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
    const QWEN2: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
    Some(match pre {
        "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone" | "minerva-7b" => (&[r"\p{N}", GPT2], false),
        "llama-bpe" | "llama3" | "falcon3" | "pixtral" => (&[LLAMA3], true),
        "qwen2" | "deepseek-r1-qwen" | "megrez" => (&[QWEN2], false),
        "gpt-2" | "phi-2" | "jina-es" | "jina-de" | "olmo" | "jais" | "trillion" => (&[GPT2], false),
        "default" | "" => (&[r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"], false),
        _ => return None,
    })
}

fn bytes_to_unicode() -> [char; 256] {
    let mut map = ['\0'; 256];
    let mut n = 0u32;
    for b in 0..256u32 {
        let printable = (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
        map[b as usize] = if printable {
            char::from_u32(b).unwrap()
        } else {
            n += 1;
            char::from_u32(255 + n).unwrap()
        };
    }
    map
}

pub(super) struct Bpe {
    regexes: Vec<Regex>,
    ignore_merges: bool,
    byte_char: [char; 256],
    char_byte: HashMap<char, u8>,
    /// (left id, right id) -> (rank, merged id)
    merges: HashMap<(u32, u32), (u32, u32)>,
}

impl Bpe {
    pub(super) fn new(pre: &str, vocab: &Vocab, by_text: &HashMap<String, u32>) -> Result<Self> {
        let (pats, ignore_merges) = pre_regexes(pre).ok_or_else(|| {
            Error::UnsupportedModel(format!(
                "pre-tokenizer '{pre}' is not supported (supported: smollm, llama-bpe, qwen2, gpt-2, default and their aliases)"
            ))
        })?;
        let regexes = pats.iter().map(|p| Regex::new(p).expect("built-in regex compiles")).collect();
        let byte_char = bytes_to_unicode();
        let char_byte = byte_char.iter().enumerate().map(|(b, &c)| (c, b as u8)).collect();
        let mut merges = HashMap::with_capacity(vocab.merges.len());
        for (rank, m) in vocab.merges.iter().enumerate() {
            let Some((a, b)) = m.split_once(' ') else { continue };
            if let (Some(&ia), Some(&ib), Some(&im)) = (by_text.get(a), by_text.get(b), by_text.get(&format!("{a}{b}"))) {
                merges.entry((ia, ib)).or_insert((rank as u32, im));
            }
        }
        Ok(Bpe { regexes, ignore_merges, byte_char, char_byte, merges })
    }

    fn split<'a>(&self, text: &'a str) -> Vec<&'a str> {
        let mut parts = vec![text];
        for re in &self.regexes {
            let mut next = Vec::with_capacity(parts.len() * 2);
            for p in parts {
                let mut last = 0;
                for m in re.find_iter(p).flatten() {
                    if m.start() > last {
                        next.push(&p[last..m.start()]);
                    }
                    if m.end() > m.start() {
                        next.push(m.as_str());
                    }
                    last = m.end();
                }
                if last < p.len() {
                    next.push(&p[last..]);
                }
            }
            parts = next;
        }
        parts
    }

    pub(super) fn encode(&self, text: &str, tok: &Tokenizer, out: &mut Vec<u32>) {
        for word in self.split(text) {
            let enc: String = word.bytes().map(|b| self.byte_char[b as usize]).collect();
            if self.ignore_merges {
                if let Some(id) = tok.lookup(&enc) {
                    out.push(id);
                    continue;
                }
            }
            // Symbols: (token id or None for a char outside the vocabulary, its text).
            let mut syms: Vec<(Option<u32>, String)> = enc.chars().map(|c| (tok.lookup(c.encode_utf8(&mut [0; 4])), c.to_string())).collect();
            loop {
                let mut best: Option<(u32, usize, u32)> = None;
                for i in 0..syms.len().saturating_sub(1) {
                    if let (Some(a), Some(b)) = (syms[i].0, syms[i + 1].0) {
                        if let Some(&(rank, merged)) = self.merges.get(&(a, b)) {
                            if best.is_none_or(|(r, _, _)| rank < r) {
                                best = Some((rank, i, merged));
                            }
                        }
                    }
                }
                let Some((_, i, merged)) = best else { break };
                let right = syms.remove(i + 1);
                syms[i].0 = Some(merged);
                syms[i].1.push_str(&right.1);
            }
            for (id, text) in syms {
                match id {
                    Some(id) => out.push(id),
                    None => out.extend(text.chars().filter_map(|c| tok.lookup(c.encode_utf8(&mut [0; 4])))),
                }
            }
        }
    }

    pub(super) fn decode_piece(&self, text: &str) -> Vec<u8> {
        let mut out = Vec::with_capacity(text.len());
        for c in text.chars() {
            match self.char_byte.get(&c) {
                Some(&b) => out.push(b),
                None => out.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes()),
            }
        }
        out
    }
}
