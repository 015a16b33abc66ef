//! Byte-level BPE (GPT-2 family): split with the pre-tokenizer's regexes, map bytes to the
//! GPT-2 printable alphabet, then apply merges lowest rank first, leftmost on ties.
//!
//! Gemma 4's SPM-style BPE (`tokenizer.ggml.model = gemma4`) shares the merge loop: spaces
//! become `▁`, the text splits only into runs of newlines and runs of anything else, symbols
//! start as UTF-8 chars (no byte alphabet), and a char outside the vocabulary falls back to its
//! `<0xXX>` byte tokens, as llama.cpp's `LLAMA_VOCAB_PRE_TYPE_GEMMA4` does.

use super::{Tokenizer, Vocab};
use crate::{Error, Result};
use fancy_regex::Regex;
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

/// llama.cpp's regex lists per `tokenizer.ggml.pre`; each regex splits the pieces of the one before.
fn pre_regexes(pre: &str) -> Option<(&'static [&'static str], bool)> {
    // The lookahead puts these in fancy_regex's backtracking VM, which keeps a stack entry per
    // char of a repetition and fails past a million (a 1 MB word). Wrapped in an atomic group
    // their plain alternatives run in the linear regex engine instead; the matches are the same,
    // as nothing after the group could backtrack into it.
    const GPT2: &str = r"(?>'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S))";
    const LLAMA3: &str =
        r"(?>(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
    const QWEN2: &str =
        r"(?>(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
    // gpt-oss's o200k (`gpt-4o`) as llama.cpp writes it: tokenizer.json's \p{Lu}/\p{Ll} classes
    // rewritten with lookaheads, a letter not a-z counting as upper and one not A-Z as lower (so
    // a non-ASCII letter is both, as in llama.cpp).
    const GPT4O: &str = concat!(
        r"(?>[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?",
        r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?",
        r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+)"
    );
    Some(match pre {
        "gpt-4o" => (&[GPT4O], false),
        "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone" | "minerva-7b" => (&[r"\p{N}", GPT2], false),
        "llama-bpe" | "llama3" | "falcon3" | "pixtral" => (&[LLAMA3], true),
        "qwen2" | "deepseek-r1-qwen" | "megrez" => (&[QWEN2], false),
        "gpt-2" | "phi-2" | "jina-es" | "jina-de" | "olmo" | "jais" | "trillion" => (&[GPT2], false),
        "default" | "" => (&[r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"], false),
        _ => return None,
    })
}

/// The end of a search window from `pos`: far fewer chars than the VM's million-entry stack.
fn window_end(p: &str, pos: usize) -> usize {
    let mut end = (pos + (1 << 18)).min(p.len());
    while !p.is_char_boundary(end) {
        end += 1;
    }
    end
}

/// llama.cpp's gemma 4 split `[^\n]+|[\n]+`: runs of newlines and runs of everything else.
fn split_newline_runs(text: &str) -> impl Iterator<Item = &str> {
    let mut rest = text;
    std::iter::from_fn(move || {
        let first = rest.chars().next()?;
        let nl = first == '\n';
        let end = rest.find(|c| (c == '\n') != nl).unwrap_or(rest.len());
        let (word, tail) = rest.split_at(end);
        rest = tail;
        Some(word)
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

/// One pre-token's symbols as a linked list over its bytes (`next` past the end is the length,
/// `prev` before the start is usize::MAX); buffers kept across the pre-tokens of one text.
#[derive(Default)]
struct Scratch {
    /// Token id per live symbol; None for a char outside the vocabulary and for merged-away ones.
    ids: Vec<Option<u32>>,
    prev: Vec<usize>,
    next: Vec<usize>,
    /// (rank, left symbol) of adjacent pairs that merge, some stale: those of the start, sorted,
    /// and those that merges made.
    initial: Vec<(u32, usize)>,
    heap: BinaryHeap<Reverse<(u32, usize)>>,
}

pub(super) struct Bpe {
    /// Gemma 4's SPM-style mode (see the module comment); the regexes are unused then.
    spm_style: bool,
    regexes: Vec<Regex>,
    ignore_merges: bool,
    byte_char: [char; 256],
    /// The token of each byte's char, so a long word needs no string lookup per byte.
    byte_id: [Option<u32>; 256],
    char_byte: HashMap<char, u8>,
    /// (left id, right id) -> (rank, merged id)
    merges: HashMap<(u32, u32), (u32, u32)>,
}

impl Bpe {
    pub(super) fn new(pre: &str, vocab: &Vocab, by_text: &HashMap<String, u32>) -> Result<Self> {
        let (pats, ignore_merges) = pre_regexes(pre).ok_or_else(|| {
            Error::UnsupportedModel(format!(
                "pre-tokenizer '{pre}' is not supported (supported: smollm, llama-bpe, qwen2, gpt-2, gpt-4o, default and their aliases)"
            ))
        })?;
        let regexes = pats.iter().map(|p| Regex::new(p).expect("built-in regex compiles")).collect();
        let byte_char = bytes_to_unicode();
        let char_byte = byte_char.iter().enumerate().map(|(b, &c)| (c, b as u8)).collect();
        let byte_id = byte_char.map(|c| by_text.get(c.encode_utf8(&mut [0; 4]) as &str).copied());
        Ok(Bpe { spm_style: false, regexes, ignore_merges, byte_char, byte_id, char_byte, merges: Self::merge_table(vocab, by_text) })
    }

    /// Gemma 4's SPM-style BPE; llama.cpp names its pre-tokenizer "gemma4" whatever the file says.
    pub(super) fn new_spm_style(vocab: &Vocab, by_text: &HashMap<String, u32>) -> Self {
        let byte_char = bytes_to_unicode();
        Bpe {
            spm_style: true,
            regexes: Vec::new(),
            ignore_merges: false,
            byte_char,
            byte_id: [None; 256],
            char_byte: HashMap::new(),
            merges: Self::merge_table(vocab, by_text),
        }
    }

    /// (left id, right id) -> (rank, merged id). llama.cpp ranks text pairs and looks the merged
    /// text up afterwards; a pair whose parts or result are not tokens is dropped here, which is
    /// the same wherever the merges were learned over the vocabulary (Hugging Face's BPE files).
    fn merge_table(vocab: &Vocab, by_text: &HashMap<String, u32>) -> HashMap<(u32, u32), (u32, u32)> {
        let mut merges = HashMap::with_capacity(vocab.merges.len());
        for (rank, m) in vocab.merges.iter().enumerate() {
            // llama.cpp splits at the first space after the first byte, so a merge of "▁" works
            // and so does one whose left side is a space in a byte-level vocabulary.
            let Some(at) = m.bytes().skip(1).position(|b| b == b' ').map(|i| i + 1) else { continue };
            let (a, b) = (&m[..at], &m[at + 1..]);
            if let (Some(&ia), Some(&ib), Some(&im)) = (by_text.get(a), by_text.get(b), by_text.get(&format!("{a}{b}"))) {
                merges.entry((ia, ib)).or_insert((rank as u32, im));
            }
        }
        merges
    }

    fn split<'a>(&self, text: &'a str) -> Vec<&'a str> {
        let mut parts = vec![text];
        for re in &self.regexes {
            let mut next = Vec::with_capacity(parts.len() * 2);
            for p in parts {
                // `last`: end of what is already pushed; `pos`: where the next search starts.
                let (mut last, mut pos) = (0, 0);
                // Whitespace runs of over a million chars still overflow the VM's stack (the
                // `\s+(?!\S)` repetition must stay there), and `find_iter` would then yield that
                // error forever. So such a run is matched a window at a time, until a match ends
                // inside its window; only where the run is cut differs from an unlimited engine.
                let mut windowed = false;
                while pos < p.len() {
                    let cut = if windowed { window_end(p, pos) } else { p.len() };
                    let m = match re.find_from_pos(&p[..cut], pos) {
                        Ok(Some(m)) => m,
                        Ok(None) if cut == p.len() => break,
                        Err(_) if !windowed => {
                            windowed = true;
                            continue;
                        }
                        // Nothing found in the window: it is left to the gap before the next match.
                        Ok(None) | Err(_) => {
                            pos = cut;
                            continue;
                        }
                    };
                    windowed &= m.end() == cut;
                    if m.start() > last {
                        next.push(&p[last..m.start()]);
                    }
                    if m.end() > m.start() {
                        next.push(m.as_str());
                        pos = m.end();
                    } else {
                        // None of the patterns matches empty, but the search must move on if one did.
                        pos = m.end() + p[m.end()..].chars().next().map_or(1, char::len_utf8);
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
        if self.spm_style {
            return self.encode_spm_style(text, tok, out);
        }
        let mut scratch = Scratch::default();
        for word in self.split(text) {
            if self.ignore_merges {
                let enc: String = word.bytes().map(|b| self.byte_char[b as usize]).collect();
                if let Some(id) = tok.lookup(&enc) {
                    out.push(id);
                    continue;
                }
            }
            let bytes = word.as_bytes();
            scratch.ids.clear();
            scratch.ids.extend(bytes.iter().map(|&b| self.byte_id[b as usize]));
            self.merge(&mut scratch);
            let s = &scratch;
            // The first symbol is never the right side of a merge, so the list starts at 0.
            let mut i = 0;
            while i < bytes.len() {
                match s.ids[i] {
                    Some(id) => out.push(id),
                    // Chars outside the vocabulary never merge: still the one char of byte i.
                    None => out.extend(tok.lookup(self.byte_char[bytes[i] as usize].encode_utf8(&mut [0; 4]))),
                }
                i = s.next[i];
            }
        }
    }

    /// Gemma 4: escape spaces, split into newline runs and the rest, merge over chars.
    fn encode_spm_style(&self, text: &str, tok: &Tokenizer, out: &mut Vec<u32>) {
        let text = text.replace(' ', "\u{2581}");
        let mut scratch = Scratch::default();
        let mut chars: Vec<&str> = Vec::new();
        for word in split_newline_runs(&text) {
            // llama.cpp's gemma 4 fix: a run of newlines that is one token stays one token
            // (merging "\n" pairs by rank could cut it differently).
            if !word.contains(|c| c != '\n') {
                if let Some(id) = tok.lookup(word) {
                    out.push(id);
                    continue;
                }
            }
            chars.clear();
            chars.extend(word.char_indices().map(|(i, c)| &word[i..i + c.len_utf8()]));
            scratch.ids.clear();
            scratch.ids.extend(chars.iter().map(|c| tok.lookup(c)));
            self.merge(&mut scratch);
            let mut i = 0;
            while i < chars.len() {
                match scratch.ids[i] {
                    Some(id) => out.push(id),
                    // A char outside the vocabulary: its bytes as <0xXX> tokens, those that exist.
                    None => out.extend(chars[i].bytes().filter_map(|b| tok.lookup(&format!("<0x{b:02X}>")))),
                }
                i = scratch.next[i];
            }
        }
    }

    /// Merges the symbols of one pre-token (their ids already in `s.ids`: one per byte, or one
    /// per char in the SPM-style mode) in place in `s`, lowest rank first and
    /// leftmost on ties, as the plain loop "find the best adjacent pair, merge it, repeat" would,
    /// but in O(n log n): that loop is quadratic, and a single 1 MB word would stall the server.
    /// A merged pair keeps its left symbol's index, so index order is sequence order, and taking
    /// candidates in (rank, left index) order picks exactly the pair the plain loop picks.
    /// Candidates go stale when a neighbour merges; they are skipped when taken, not removed.
    fn merge(&self, s: &mut Scratch) {
        let n = s.ids.len();
        s.next.clear();
        s.next.extend(1..=n);
        s.prev.clear();
        s.prev.extend((0..n).map(|i| i.wrapping_sub(1)));
        // The pairs there at the start, in merge order; pairs that merges make go to the heap.
        // Taking the smaller head of the two each time keeps one order, and reading most of
        // the candidates from a sorted list rather than a million-entry heap saves cache misses.
        s.initial.clear();
        s.initial.extend((1..n).filter_map(|r| Some((self.pair(&s.ids, r - 1, r)?.0, r - 1))));
        s.initial.sort_unstable();
        s.heap.clear();
        let mut taken = 0;
        loop {
            let from_heap = match (s.initial.get(taken), s.heap.peek()) {
                (Some(a), Some(Reverse(b))) => b < a,
                (None, Some(_)) => true,
                (Some(_), None) => false,
                (None, None) => break,
            };
            let (rank, l) = if from_heap {
                s.heap.pop().expect("peeked").0
            } else {
                taken += 1;
                s.initial[taken - 1]
            };
            let r = s.next[l];
            // A rank is one merge line, so the same rank means the same pair is still there; a
            // merged-away symbol has no id and fails this too.
            let merged = match (r < n).then(|| self.pair(&s.ids, l, r)).flatten() {
                Some((now, merged)) if now == rank => merged,
                _ => continue,
            };
            s.ids[l] = Some(merged);
            s.ids[r] = None;
            let rn = s.next[r];
            s.next[l] = rn;
            if rn < n {
                s.prev[rn] = l;
                s.heap.extend(self.pair(&s.ids, l, rn).map(|(rank, _)| Reverse((rank, l))));
            }
            let p = s.prev[l];
            if p < n {
                s.heap.extend(self.pair(&s.ids, p, l).map(|(rank, _)| Reverse((rank, p))));
            }
        }
    }

    /// (rank, merged id) of the adjacent symbols `l` and `r`, if they merge.
    fn pair(&self, ids: &[Option<u32>], l: usize, r: usize) -> Option<(u32, u32)> {
        self.merges.get(&(ids[l]?, ids[r]?)).copied()
    }

    pub(super) fn decode_piece(&self, text: &str) -> Vec<u8> {
        if self.spm_style {
            return text.replace('\u{2581}', " ").into_bytes();
        }
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

#[cfg(test)]
mod tests {
    use super::super::{Kind, Tokenizer, Vocab, TYPE_NORMAL};
    use super::{bytes_to_unicode, pre_regexes, Bpe};
    use fancy_regex::Regex;
    use std::collections::HashMap;
    use std::time::Instant;

    /// Deterministic xorshift64*, so failures reproduce without a rand crate.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
        }
        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }
    }

    #[derive(Default)]
    struct Builder {
        tokens: Vec<String>,
        index: HashMap<String, usize>,
        merges: Vec<String>,
    }
    impl Builder {
        fn token(&mut self, t: &str) {
            if !self.index.contains_key(t) {
                self.index.insert(t.to_string(), self.tokens.len());
                self.tokens.push(t.to_string());
            }
        }
        /// Byte-level tokens for the bytes of `s`, one per byte.
        fn bytes_of(&mut self, s: &str) {
            let bc = bytes_to_unicode();
            for b in s.bytes() {
                self.token(&bc[b as usize].to_string());
            }
        }
        fn merge(&mut self, a: &str, b: &str) {
            self.token(&format!("{a}{b}"));
            self.merges.push(format!("{a} {b}"));
        }
        fn build(self, pre: &str) -> Tokenizer {
            let n = self.tokens.len();
            let vocab = Vocab {
                tokens: self.tokens,
                types: vec![TYPE_NORMAL; n],
                scores: Vec::new(),
                merges: self.merges,
                bos: None,
                eos: None,
                eog: Vec::new(),
                add_bos: false,
                add_space_prefix: false,
            };
            Tokenizer::new("gpt2", pre, vocab).unwrap()
        }
    }

    fn bpe(tok: &Tokenizer) -> &Bpe {
        match &tok.kind {
            Kind::Bpe(b) => b,
            Kind::Spm => unreachable!(),
        }
    }

    /// The quadratic merge loop this module used before, kept as the specification.
    fn reference_encode(b: &Bpe, text: &str, tok: &Tokenizer) -> Vec<u32> {
        let mut out = Vec::new();
        for word in b.split(text) {
            let enc: String = word.bytes().map(|x| b.byte_char[x as usize]).collect();
            if b.ignore_merges {
                if let Some(id) = tok.lookup(&enc) {
                    out.push(id);
                    continue;
                }
            }
            let mut syms: Vec<(Option<u32>, String)> = enc.chars().map(|c| (tok.lookup(c.encode_utf8(&mut [0; 4])), c.to_string())).collect();
            loop {
                let mut best: Option<(u32, usize, u32)> = None;
                for i in 0..syms.len().saturating_sub(1) {
                    if let (Some(x), Some(y)) = (syms[i].0, syms[i + 1].0) {
                        if let Some(&(rank, merged)) = b.merges.get(&(x, y)) {
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
        out
    }

    fn encode(tok: &Tokenizer, text: &str) -> Vec<u32> {
        let mut out = Vec::new();
        bpe(tok).encode(text, tok, &mut out);
        out
    }

    #[test]
    fn equal_pairs_merge_leftmost_first() {
        let mut v = Builder::default();
        v.bytes_of("a");
        v.merge("a", "a");
        let tok = v.build("gpt-2");
        let (a, aa) = (tok.lookup("a").unwrap(), tok.lookup("aa").unwrap());
        assert_eq!(encode(&tok, "aaa"), vec![aa, a]);
        assert_eq!(encode(&tok, "aaaaa"), vec![aa, aa, a]);
        for n in 0..40 {
            let s = "a".repeat(n);
            assert_eq!(encode(&tok, &s), reference_encode(bpe(&tok), &s, &tok), "{n}");
        }
    }

    /// A small alphabet (with a two-byte char and a byte outside the vocabulary) and random merge
    /// tables, including merges whose result another pair also makes, merges of unknown tokens
    /// and repeated merge lines.
    fn random_tokenizer(rng: &mut Rng, pre: &str) -> Tokenizer {
        let mut v = Builder::default();
        v.bytes_of("abc é\n");
        let n_merges = 5 + rng.below(60);
        for _ in 0..n_merges {
            match rng.below(10) {
                0 => v.merges.push("z a".into()),
                1 if !v.merges.is_empty() => {
                    let m = v.merges[rng.below(v.merges.len())].clone();
                    v.merges.push(m);
                }
                _ => {
                    // Short tokens are picked more often, so the merges chain and overlap.
                    let pick = |rng: &mut Rng, v: &Builder| {
                        let k = rng.below(v.tokens.len()).min(rng.below(v.tokens.len()));
                        v.tokens[k].clone()
                    };
                    let (a, b) = (pick(rng, &v), pick(rng, &v));
                    v.merge(&a, &b);
                }
            }
        }
        v.build(pre)
    }

    fn random_text(rng: &mut Rng, len: usize) -> String {
        const ALPHABET: [&str; 9] = ["a", "a", "b", "b", "c", "é", "z", " ", "\n"];
        let spaces = rng.below(2) == 0;
        let n = if spaces { 9 } else { 7 };
        (0..len).map(|_| ALPHABET[rng.below(n)]).collect()
    }

    #[test]
    fn merges_match_the_reference_on_random_text() {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        for round in 0..300 {
            let pre = ["gpt-2", "smollm", "llama3", "qwen2"][round % 4];
            let tok = random_tokenizer(&mut rng, pre);
            for _ in 0..30 {
                let max = if rng.below(4) == 0 { 300 } else { 20 };
                let len = rng.below(max);
                let text = random_text(&mut rng, len);
                assert_eq!(encode(&tok, &text), reference_encode(bpe(&tok), &text, &tok), "round {round} pre {pre} text {text:?}");
            }
        }
    }

    /// The patterns as llama.cpp writes them, without the atomic group.
    fn plain_regexes(pre: &str) -> Vec<Regex> {
        let plain = |p: &str| p.strip_prefix("(?>").and_then(|p| p.strip_suffix(')')).unwrap_or(p).to_string();
        pre_regexes(pre).unwrap().0.iter().map(|p| Regex::new(&plain(p)).unwrap()).collect()
    }

    /// The split this module used before, for texts far below the VM's limits.
    fn reference_split<'a>(regexes: &[Regex], text: &'a str) -> Vec<&'a str> {
        let mut parts = vec![text];
        for re in regexes {
            let mut next = Vec::new();
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

    #[test]
    fn split_matches_the_plain_patterns() {
        const ALPHABET: [&str; 26] = [
            "a", "B", "é", "ß", "中", "\u{301}", "1", "٣", "½", "123", " ", " ", "  ", "\n", "\r", "\t", "\u{a0}", "\u{3000}", "'", "'s", "'S", "'ll", "!",
            "?.", "$+<", "🙂",
        ];
        let mut rng = Rng(0x51ed_2701_c0ff_ee11);
        for pre in ["gpt-2", "smollm", "llama3", "qwen2", "default", "gpt-4o"] {
            let mut v = Builder::default();
            v.bytes_of("a");
            let tok = v.build(pre);
            let plain = plain_regexes(pre);
            for _ in 0..20_000 {
                let len = rng.below(24);
                let text: String = (0..len).map(|_| ALPHABET[rng.below(ALPHABET.len())]).collect();
                assert_eq!(bpe(&tok).split(&text), reference_split(&plain, &text), "pre {pre} text {text:?}");
            }
        }
    }

    #[test]
    fn gpt_4o_splits_case_runs_contractions_and_digit_triples() {
        let mut v = Builder::default();
        v.bytes_of("a");
        let tok = v.build("gpt-4o");
        // A capitalised word, a contraction kept on its word, digits in threes, a lowercase run
        // with a non-ASCII letter ended by capitals (a run of capitals of its own), newlines.
        let text = "Hello World's 12345 na\u{ef}veTEST\n\n x";
        assert_eq!(bpe(&tok).split(text), ["Hello", " World's", " ", "123", "45", " na\u{ef}ve", "TEST", "\n\n", " x"]);
    }

    /// Runs past fancy_regex's million-entry backtracking stack used to make `split` loop forever.
    #[test]
    fn runs_of_millions_of_chars_split_and_encode() {
        for pre in ["gpt-2", "llama3", "qwen2", "default", "gpt-4o"] {
            let mut v = Builder::default();
            v.bytes_of("a 1\n'");
            v.merge("a", "a");
            let tok = v.build(pre);
            let long = 1_200_000;
            for text in [
                "a".repeat(long),
                "1".repeat(long),
                "'".repeat(long),
                " ".repeat(long) + "a",
                "\n".repeat(long),
                "a".to_string() + &" \n".repeat(long / 2) + "a",
            ] {
                let parts = bpe(&tok).split(&text);
                assert_eq!(parts.concat(), text, "pre {pre}");
                // gpt-4o's letter classes are lookaheads, which keep its letter runs in the
                // backtracking VM: a run past a million chars is cut at window ends there.
                if text.starts_with('a') && !text.contains(' ') && pre != "gpt-4o" {
                    assert_eq!(parts.len(), 1, "pre {pre}: a letter run is one pre-token");
                }
                let ids = encode(&tok, &text);
                assert!(!ids.is_empty());
            }
        }
    }

    /// All byte tokens, all merges of two lowercase letters, and doubling chains for 'a' and 🙂.
    fn bench_tokenizer() -> Tokenizer {
        let mut v = Builder::default();
        let bc = bytes_to_unicode();
        for c in bc {
            v.token(&c.to_string());
        }
        let letters: Vec<String> = (b'a'..=b'z').map(|c| (c as char).to_string()).collect();
        for x in &letters {
            for y in &letters {
                v.merge(x, y);
            }
        }
        let mut a = "a".to_string();
        for _ in 0..8 {
            v.merge(&a, &a);
            a = a.repeat(2);
        }
        let e: Vec<String> = "🙂".bytes().map(|b| bc[b as usize].to_string()).collect();
        v.merge(&e[0], &e[1]);
        v.merge(&(e[0].clone() + &e[1]), &e[2]);
        let mut emoji = e.concat();
        v.merge(&(e[0].clone() + &e[1] + &e[2]), &e[3]);
        for _ in 0..4 {
            v.merge(&emoji, &emoji);
            emoji = emoji.repeat(2);
        }
        v.build("gpt-2")
    }

    /// Speed is measured, not asserted: `cargo test --release -p dasllama bpe -- --ignored --nocapture`.
    #[test]
    #[ignore]
    fn long_single_words_encode_in_near_linear_time() {
        let bytes: usize = std::env::var("BPE_BENCH_BYTES").ok().and_then(|s| s.parse().ok()).unwrap_or(1 << 20);
        let tok = bench_tokenizer();
        let mut rng = Rng(42);
        let inputs = [
            ("'a' run", "a".repeat(bytes)),
            ("emoji run", "🙂".repeat(bytes / 4)),
            ("200k emoji", "🙂".repeat(200_000)),
            ("random letters", (0..bytes).map(|_| (b'a' + rng.below(26) as u8) as char).collect::<String>()),
            ("space run", " ".repeat(bytes) + "a"),
            ("prose", "the quick brown fox, it's 2024! ".repeat(bytes / 32)),
        ];
        for (what, text) in inputs {
            let t = Instant::now();
            let words = bpe(&tok).split(&text).len();
            let split = t.elapsed();
            let t = Instant::now();
            let ids = encode(&tok, &text);
            let total = t.elapsed();
            println!("{what}: {} bytes, {words} pre-tokens, split {split:?}, encode {total:?}, {} tokens", text.len(), ids.len());
        }
    }

    /// Gemma 4's SPM-style mode: spaces are `▁`, newline runs that are tokens stay whole, other
    /// runs merge by rank, and a char outside the vocabulary becomes its `<0xXX>` bytes.
    #[test]
    fn spm_style_escapes_spaces_keeps_newline_runs_and_falls_back_to_bytes() {
        let mut tokens: Vec<String> = (0..=255u8).map(|b| format!("<0x{b:02X}>")).collect();
        let mut types = vec![super::super::TYPE_BYTE; 256];
        for t in ["\u{2581}", "a", "b", "\n", "\n\n", "\u{2581}a", "ab", "\u{2581}ab"] {
            tokens.push(t.to_string());
            types.push(TYPE_NORMAL);
        }
        let merges = ["\u{2581} a", "a b", "\u{2581}a b", "\n \n"].map(String::from).to_vec();
        let n = tokens.len();
        let vocab = Vocab { tokens, types, scores: Vec::new(), merges, bos: None, eos: None, eog: Vec::new(), add_bos: false, add_space_prefix: false };
        assert_eq!(vocab.types.len(), n);
        let tok = Tokenizer::new("gemma4", "gemma4", vocab).unwrap();
        let id = |t: &str| tok.lookup(t).unwrap();
        let ids = tok.encode(" ab\n\nab\n\n\né", Some(false), false);
        // "▁a" (rank 0) before "ab" (rank 1), then "▁a"+"b"; "\n\n" is one token; three newlines
        // are not, so they merge by rank; é is two bytes.
        let want = [id("\u{2581}ab"), id("\n\n"), id("ab"), id("\n\n"), id("\n"), id("<0xC3>"), id("<0xA9>")];
        assert_eq!(ids, want);
        assert_eq!(tok.decode(&ids, false), " ab\n\nab\n\n\né".as_bytes());
    }
}
