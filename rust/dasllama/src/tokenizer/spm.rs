//! SentencePiece (llama.cpp's `llm_tokenizer_spm`): merge adjacent symbols into the vocabulary
//! piece with the highest score, leftmost first; unknown characters fall back to `<0xXX>` bytes.

use super::Tokenizer;
use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};

struct Sym {
    start: usize,
    n: usize,
    prev: isize,
    next: isize,
}

struct Bigram {
    left: usize,
    right: usize,
    score: f32,
    size: usize,
}

impl PartialEq for Bigram {
    fn eq(&self, o: &Self) -> bool {
        self.cmp(o) == Ordering::Equal
    }
}
impl Eq for Bigram {}
impl PartialOrd for Bigram {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Bigram {
    /// Highest score first, then the leftmost.
    fn cmp(&self, o: &Self) -> Ordering {
        self.score.total_cmp(&o.score).then(o.left.cmp(&self.left))
    }
}

pub(super) fn byte_of(text: &str) -> Option<u8> {
    let hex = text.strip_prefix("<0x")?.strip_suffix('>')?;
    u8::from_str_radix(hex, 16).ok()
}

pub(super) fn encode(text: &str, tok: &Tokenizer, out: &mut Vec<u32>) {
    let mut syms: Vec<Sym> = Vec::new();
    for (i, (start, c)) in text.char_indices().enumerate() {
        syms.push(Sym { start, n: c.len_utf8(), prev: i as isize - 1, next: i as isize + 1 });
    }
    if let Some(last) = syms.last_mut() {
        last.next = -1;
    }
    let mut heap = BinaryHeap::new();
    let mut rev: HashMap<(usize, usize), (usize, usize)> = HashMap::new();
    let try_add = |l: isize, r: isize, syms: &[Sym], heap: &mut BinaryHeap<Bigram>, rev: &mut HashMap<(usize, usize), (usize, usize)>| {
        if l < 0 || r < 0 {
            return;
        }
        let (l, r) = (l as usize, r as usize);
        let s = &text[syms[l].start..syms[r].start + syms[r].n];
        if let Some(id) = tok.lookup(s) {
            heap.push(Bigram { left: l, right: r, score: tok.vocab.scores.get(id as usize).copied().unwrap_or(0.0), size: s.len() });
            rev.insert((syms[l].start, s.len()), (l, r));
        }
    };
    for i in 1..syms.len() {
        try_add(i as isize - 1, i as isize, &syms, &mut heap, &mut rev);
    }
    while let Some(b) = heap.pop() {
        let (l, r) = (b.left, b.right);
        if syms[l].n == 0 || syms[r].n == 0 || syms[l].n + syms[r].n != b.size {
            continue;
        }
        syms[l].n += syms[r].n;
        syms[r].n = 0;
        syms[l].next = syms[r].next;
        if syms[r].next >= 0 {
            let nx = syms[r].next as usize;
            syms[nx].prev = l as isize;
        }
        let (p, nx) = (syms[l].prev, syms[l].next);
        try_add(p, l as isize, &syms, &mut heap, &mut rev);
        try_add(l as isize, nx, &syms, &mut heap, &mut rev);
    }
    let mut i = if syms.is_empty() { -1 } else { 0 };
    while i >= 0 {
        let s = &syms[i as usize];
        resegment(text, s.start, s.n, &syms, &rev, tok, out);
        i = s.next;
    }
}

fn resegment(text: &str, start: usize, n: usize, syms: &[Sym], rev: &HashMap<(usize, usize), (usize, usize)>, tok: &Tokenizer, out: &mut Vec<u32>) {
    let s = &text[start..start + n];
    if let Some(id) = tok.lookup(s) {
        out.push(id);
        return;
    }
    match rev.get(&(start, n)) {
        Some(&(l, r)) => {
            resegment(text, syms[l].start, syms[r].start - syms[l].start, syms, rev, tok, out);
            resegment(text, syms[r].start, start + n - syms[r].start, syms, rev, tok, out);
        }
        None => {
            for b in s.bytes() {
                if let Some(id) = tok.lookup(&format!("<0x{b:02X}>")) {
                    out.push(id);
                }
            }
        }
    }
}
