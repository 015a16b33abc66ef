//! The scheduler on a tiny synthetic llama (random f32 weights, a byte vocabulary): admission
//! order, prefill chunking, waiting and resuming, cancellation, the prefix cache, speculation
//! (`speculation`), and the K/V pages coming back to the pool after every path.

mod speculation;

use super::*;
use crate::model::{MetaValue, Metadata, QuantMode, TensorInfo};
use crate::runtime::{Config, Runtime};
use crate::tokenizer::{Tokenizer, Vocab};
use std::collections::HashMap;
use std::io::Write;

const DIM: usize = 64;
const HEADS: usize = 4;
const KV_HEADS: usize = 2;
const HEAD_DIM: usize = 16;
const HIDDEN: usize = 128;
const LAYERS: usize = 2;
const CTX: usize = 256;
/// 256 byte tokens and an end token.
const VOCAB: usize = 257;

/// A byte-level vocabulary: every byte is a token, plus an end token.
fn bytes_tokenizer() -> Tokenizer {
    let mut tokens: Vec<String> = (0..=255u8).map(|b| format!("<0x{b:02X}>")).collect();
    tokens.push("</s>".into());
    let mut types = vec![crate::tokenizer::TYPE_BYTE; 256];
    types.push(crate::tokenizer::TYPE_CONTROL);
    let vocab =
        Vocab { tokens, types, scores: vec![0.0; VOCAB], merges: vec![], bos: None, eos: Some(256), eog: vec![], add_bos: false, add_space_prefix: false };
    Tokenizer::new("llama", "default", vocab).expect("a byte vocabulary")
}

/// A tiny llama with random weights drawn from `seed`, written to a file of f32 tensors and loaded
/// as the Python loader would (the tensor table and metadata given, the file mapped).
fn tiny_model(seed: u64) -> Arc<Model> {
    static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let path = std::env::temp_dir().join(format!("dasllama-sched-{}-{}.bin", std::process::id(), N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)));
    let mut state = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407) | 1;
    let mut uniform = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 11) as f32 / (1u64 << 53) as f32 * 2.0 - 1.0
    };
    let (mut bytes, mut tensors) = (Vec::<u8>::new(), Vec::new());
    let mut put = |name: String, shape: Vec<u64>, values: Vec<f32>| {
        while bytes.len() % 64 != 0 {
            bytes.push(0);
        }
        tensors.push(TensorInfo { name, ty: 0, shape, offset: bytes.len() as u64 });
        bytes.extend(values.iter().flat_map(|v| v.to_le_bytes()));
    };
    let mut mat = |put: &mut dyn FnMut(String, Vec<u64>, Vec<f32>), name: String, rows: usize, cols: usize, scale: f32| {
        put(name, vec![cols as u64, rows as u64], (0..rows * cols).map(|_| scale * uniform()).collect())
    };
    mat(&mut put, "token_embd.weight".into(), VOCAB, DIM, 1.0);
    for i in 0..LAYERS {
        put(format!("blk.{i}.attn_norm.weight"), vec![DIM as u64], vec![1.0; DIM]);
        mat(&mut put, format!("blk.{i}.attn_q.weight"), HEADS * HEAD_DIM, DIM, 0.2);
        mat(&mut put, format!("blk.{i}.attn_k.weight"), KV_HEADS * HEAD_DIM, DIM, 0.2);
        mat(&mut put, format!("blk.{i}.attn_v.weight"), KV_HEADS * HEAD_DIM, DIM, 0.2);
        mat(&mut put, format!("blk.{i}.attn_output.weight"), DIM, HEADS * HEAD_DIM, 0.2);
        put(format!("blk.{i}.ffn_norm.weight"), vec![DIM as u64], vec![1.0; DIM]);
        mat(&mut put, format!("blk.{i}.ffn_gate.weight"), HIDDEN, DIM, 0.2);
        mat(&mut put, format!("blk.{i}.ffn_up.weight"), HIDDEN, DIM, 0.2);
        mat(&mut put, format!("blk.{i}.ffn_down.weight"), DIM, HIDDEN, 0.2);
    }
    put("output_norm.weight".into(), vec![DIM as u64], vec![1.0; DIM]);
    // An output matrix of its own: with the embedding's, a tiny model echoes its last token.
    mat(&mut put, "output.weight".into(), VOCAB, DIM, 1.0);
    std::fs::File::create(&path).and_then(|mut f| f.write_all(&bytes)).expect("write the tiny model");
    let sizes = [("block_count", LAYERS), ("context_length", CTX), ("embedding_length", DIM), ("feed_forward_length", HIDDEN)];
    let heads =
        [("attention.head_count", HEADS), ("attention.head_count_kv", KV_HEADS), ("attention.key_length", HEAD_DIM), ("attention.value_length", HEAD_DIM)];
    let mut meta: HashMap<String, MetaValue> = sizes.iter().chain(&heads).map(|&(k, v)| (k.to_string(), MetaValue::Int(v as i64))).collect();
    meta.insert("attention.layer_norm_rms_epsilon".into(), MetaValue::Float(1e-6));
    meta.insert("rope.freq_base".into(), MetaValue::Float(10000.0));
    let rt = Runtime::new(Config { threads: 2, ..Config::default() });
    let model = Model::load(&rt, &path, "llama", &Metadata::new("llama", meta), &tensors, bytes_tokenizer(), QuantMode::Native, Numerics::Fast)
        .expect("load the tiny model");
    // The map outlives the file's name.
    let _ = std::fs::remove_file(&path);
    Arc::new(model)
}

/// A scheduler of `streams` streams over a paged pool of 16-row pages, fixed chunks of `chunk`.
fn sched(model: &Arc<Model>, streams: usize, chunk: usize) -> Scheduler {
    let mut s = Scheduler::new(model.clone(), streams, 16, chunk, 16, 0, KvCodec::F16).expect("a scheduler");
    s.set_step_budget(None);
    s
}

fn req(id: i64, prompt: Vec<u32>, max_new: usize) -> PendingReq {
    PendingReq {
        id,
        prompt,
        close_toks: vec![],
        stop_ids: vec![],
        params: SamplingParams::default(),
        max_new,
        seed: 7,
        logprobs: None,
        ignore_eos: true,
        grammar: None,
        nothink: None,
        images: vec![],
        progress: false,
    }
}

/// A prompt of `n` byte tokens, starting from `from`.
fn prompt(n: usize, from: u32) -> Vec<u32> {
    (0..n as u32).map(|i| (from + 7 * i) % 256).collect()
}

/// Step until nothing is queued or running; every event, in order.
fn run(s: &mut Scheduler) -> Vec<SchedEvent> {
    let mut events = Vec::new();
    for _ in 0..10_000 {
        if !s.step(&mut events).expect("a step") {
            return events;
        }
    }
    panic!("the scheduler did not drain");
}

/// Each request's sampled tokens, by id.
fn tokens_by_id(events: &[SchedEvent]) -> HashMap<i64, Vec<i64>> {
    let mut out: HashMap<i64, Vec<i64>> = HashMap::new();
    for e in events.iter().filter(|e| e.kind == EventKind::Piece) {
        out.entry(e.id).or_default().push(e.token);
    }
    out
}

fn finished(events: &[SchedEvent], id: i64) -> &SchedEvent {
    events.iter().find(|e| e.id == id && e.kind == EventKind::Finished).expect("a finished event")
}

/// No stream holds a page: every page is free or held by the prefix cache alone; and with the
/// cache cleared, every page is free.
fn assert_pages_back(s: &mut Scheduler) {
    let st = s.pool().expect("a paged pool").stats();
    assert_eq!(st.pages_free + st.pages_cached, st.pages_total, "{st:?}");
    assert_eq!(st.pages_shared, 0, "{st:?}");
    s.clear_prefix_cache();
    let st = s.pool().expect("a paged pool").stats();
    assert_eq!(st.pages_used, 0, "{st:?}");
}

#[test]
fn requests_are_admitted_in_order_and_wait_for_a_free_stream() {
    let m = tiny_model(1);
    let mut s = Scheduler::new(m.clone(), 2, 3, 64, 16, 0, KvCodec::F16).unwrap();
    // Two free streams and a queue of three: five are taken before any step runs.
    for id in 1..=5 {
        assert!(s.submit(req(id, prompt(10, id as u32), 4)).unwrap());
    }
    // A sixth is refused (not an error), a repeated id is an error.
    assert!(!s.submit(req(6, prompt(10, 6), 4)).unwrap());
    assert!(s.submit(req(1, prompt(10, 1), 4)).is_err());
    assert!(s.submit(req(9, vec![], 4)).is_err());
    assert!(s.submit(req(9, vec![300], 4)).is_err());
    assert!(s.submit(req(9, prompt(CTX, 0), 4)).is_err());
    let mut events = Vec::new();
    s.step(&mut events).unwrap();
    let live: Vec<i64> = s.stream_positions().iter().map(|p| p.0).collect();
    assert_eq!(live, vec![1, 2], "the oldest two run");
    assert_eq!(s.n_queued(), 3);
    // With both streams busy, the queue's three places are all taken.
    assert!(!s.submit(req(6, prompt(10, 6), 4)).unwrap());
    // Streams are numbered by the free slot they took.
    let first: Vec<(i64, usize)> = events.iter().map(|e| (e.id, e.stream)).collect();
    assert_eq!(first, vec![(1, 0), (2, 1)]);
    events.extend(run(&mut s));
    // Request 3 ran only once a stream came free, and in that stream.
    let first_3 = events.iter().position(|e| e.id == 3).unwrap();
    let done = events.iter().position(|e| e.kind == EventKind::Finished).unwrap();
    assert!(first_3 > done, "request 3 started before a stream was free");
    for id in 1..=5 {
        let f = finished(&events, id);
        assert_eq!((f.finish, f.n_gen, f.n_prompt), (Finish::Length, 4, 10));
    }
    assert_eq!(s.stats.finished, 5);
    assert_eq!((s.n_active(), s.n_queued()), (0, 0));
    assert_pages_back(&mut s);
}

#[test]
fn prefill_goes_in_chunks_oldest_first_and_no_larger_than_the_budget_allows() {
    let m = tiny_model(2);
    let mut s = sched(&m, 2, 8);
    s.submit(req(1, prompt(5, 1), 9)).unwrap();
    s.submit(req(2, prompt(20, 2), 2)).unwrap();
    let mut events = Vec::new();
    s.step(&mut events).unwrap();
    // One chunk of 8: the first prompt whole, then 3 of the second.
    let pos: Vec<(i64, usize)> = s.stream_positions().iter().map(|p| (p.0, p.2)).collect();
    assert_eq!(pos, vec![(1, 5), (2, 3)]);
    assert_eq!(events.len(), 1, "the first prompt is done and gave its first token");
    s.step(&mut events).unwrap();
    // The decode row of the first, and 8 more of the second.
    let pos: Vec<(i64, usize)> = s.stream_positions().iter().map(|p| (p.0, p.2)).collect();
    assert_eq!(pos, vec![(1, 6), (2, 11)]);
    run(&mut s);
    assert_eq!(s.stats.prefill_tokens, 25);
    assert_eq!(s.stats.prefill_chunks, 4);
    assert_pages_back(&mut s);

    // Under a step budget: no piece past chunk_tokens, and at least MIN_CHUNK a step however
    // small the budget, so a prompt always advances.
    let mut s = Scheduler::new(m.clone(), 1, 16, 48, 16, 0, KvCodec::F16).unwrap();
    s.set_step_budget(Some(1e-9));
    s.submit(req(1, prompt(200, 3), 1)).unwrap();
    let mut fed = 0;
    while s.n_active() + s.n_queued() > 0 {
        s.step(&mut events).unwrap();
        let now = s.stream_positions().first().map_or(200, |p| p.2);
        assert!(now - fed <= 48, "a chunk of {} past chunk_tokens", now - fed);
        assert!(now - fed >= MIN_CHUNK.min(200 - fed), "a chunk of {} under MIN_CHUNK", now - fed);
        fed = now;
    }
    assert_eq!(s.stats.prefill_tokens, 200);
    assert_pages_back(&mut s);
}

#[test]
fn a_queued_request_resumes_into_the_stream_an_eviction_frees() {
    let m = tiny_model(3);
    let mut s = sched(&m, 1, 64);
    s.submit(req(1, prompt(10, 1), 100)).unwrap();
    s.submit(req(2, prompt(10, 2), 3)).unwrap();
    let mut events = Vec::new();
    for _ in 0..3 {
        s.step(&mut events).unwrap();
    }
    assert_eq!(s.n_queued(), 1, "the second waits while the only stream is busy");
    assert!(s.evict(1, &mut events));
    assert_eq!(s.n_active(), 0, "the stream is freed at once");
    events.extend(run(&mut s));
    let f = finished(&events, 2);
    assert_eq!((f.finish, f.stream, f.n_gen), (Finish::Length, 0, 3));
    // What it produced is what it produces alone.
    let mut alone = sched(&m, 1, 64);
    alone.submit(req(2, prompt(10, 2), 3)).unwrap();
    assert_eq!(tokens_by_id(&run(&mut alone))[&2], tokens_by_id(&events)[&2]);
    assert_pages_back(&mut s);
}

#[test]
fn cancelling_mid_prefill_mid_decode_and_in_the_queue_frees_everything() {
    let m = tiny_model(4);
    let mut s = sched(&m, 2, 8);
    s.submit(req(2, prompt(4, 2), 50)).unwrap();
    s.submit(req(1, prompt(40, 1), 50)).unwrap();
    s.submit(req(3, prompt(4, 3), 50)).unwrap();
    let mut events = Vec::new();
    for _ in 0..3 {
        s.step(&mut events).unwrap();
    }
    let pos: HashMap<i64, usize> = s.stream_positions().iter().map(|p| (p.0, p.2)).collect();
    assert!(pos[&1] > 0 && pos[&1] < 40, "request 1 is mid-prefill: {pos:?}");
    assert!(pos[&2] > 4, "request 2 is decoding: {pos:?}");
    assert!(s.pool().unwrap().stats().pages_used > 0);
    // In the queue: finished at once, on no stream.
    assert!(s.evict(3, &mut events));
    assert_eq!((finished(&events, 3).finish, finished(&events, 3).stream), (Finish::Evicted, usize::MAX));
    assert!(s.evict(1, &mut events));
    let f = finished(&events, 1);
    assert_eq!((f.finish, f.n_gen), (Finish::Evicted, 0));
    assert!(s.evict(2, &mut events));
    assert!(matches!(finished(&events, 2), SchedEvent { finish: Finish::Evicted, n_gen: 2.., .. }));
    assert!(!s.evict(2, &mut events), "already gone");
    assert!(!s.step(&mut events).unwrap());
    assert_eq!(s.stats.finished, 3);
    // An evicted stream donates nothing: no page is left, cached or not.
    let st = s.pool().unwrap().stats();
    assert_eq!(st.pages_free, st.pages_total, "{st:?}");
    assert_pages_back(&mut s);
}

#[test]
fn a_stop_token_ends_the_stream_between_pieces() {
    let m = tiny_model(5);
    let mut s = sched(&m, 1, 64);
    s.submit(req(1, prompt(12, 5), 8)).unwrap();
    let toks = tokens_by_id(&run(&mut s))[&1].clone();
    // The first token not seen before, past the first.
    let at = (1..toks.len()).find(|&j| !toks[..j].contains(&toks[j])).expect("a tiny model that says more than one token");
    let mut r = req(2, prompt(12, 5), 8);
    r.stop_ids = vec![toks[at] as u32];
    s.submit(r).unwrap();
    let events = run(&mut s);
    let f = finished(&events, 2);
    assert_eq!((f.finish, f.token, f.n_gen), (Finish::Stop, toks[at], at + 1));
    assert_eq!(tokens_by_id(&events)[&2], toks[..at]);
    assert_pages_back(&mut s);
}

#[test]
fn a_prefix_is_attached_from_the_cache_and_released_with_the_stream() {
    let m = tiny_model(6);
    let system = prompt(40, 6);
    let mut a = req(1, system.clone(), 5);
    a.close_toks = vec![10, 11];
    let mut b_prompt = system.clone();
    b_prompt.extend(prompt(9, 100));
    let b = req(2, b_prompt.clone(), 6);

    let mut s = sched(&m, 2, 64);
    s.submit(a.clone()).unwrap();
    let first = run(&mut s);
    assert_eq!(finished(&first, 1).n_cached, 0);
    let st = s.pool().unwrap().stats();
    assert!(st.pages_cached >= 2, "the finished turn donated its full pages: {st:?}");
    s.submit(b.clone()).unwrap();
    let second = run(&mut s);
    // Two whole pages of the 40 shared tokens (the third is partial).
    assert_eq!(finished(&second, 2).n_cached, 32);
    assert_eq!(s.stats.cached_tokens, 32);
    // What it says is what it says with nothing cached.
    let mut cold = sched(&m, 2, 64);
    cold.submit(b).unwrap();
    let cold_events = run(&mut cold);
    assert_eq!(finished(&cold_events, 2).n_cached, 0);
    assert_eq!(tokens_by_id(&second)[&2], tokens_by_id(&cold_events)[&2]);
    // Two streams admitted together with one prefix: the second attaches what the first
    // prefilled (it looks until its first chunk, and the first is offered as soon as it is done).
    let mut s2 = sched(&m, 2, 49);
    s2.submit(req(3, b_prompt.clone(), 3)).unwrap();
    s2.submit(req(4, b_prompt, 3)).unwrap();
    let events = run(&mut s2);
    assert_eq!(finished(&events, 3).n_cached, 0);
    assert_eq!(finished(&events, 4).n_cached, 48);
    assert_eq!(tokens_by_id(&events)[&3], tokens_by_id(&events)[&4]);
    assert_pages_back(&mut s);
    assert_pages_back(&mut s2);
    assert_pages_back(&mut cold);
}

#[cfg(feature = "fault-injection")]
#[test]
fn a_stream_that_fails_ends_alone_and_returns_its_pages() {
    let m = tiny_model(10);
    let mut s = sched(&m, 2, 64);
    s.submit(req(1, prompt(20, 1), 10)).unwrap();
    s.submit(req(2, prompt(20, 2), 10)).unwrap();
    let mut events = Vec::new();
    s.step(&mut events).unwrap();
    assert!(s.inject_fault(1));
    events.extend(run(&mut s));
    assert!(matches!(finished(&events, 1), SchedEvent { finish: Finish::Error, error: Some(_), .. }));
    assert_eq!((finished(&events, 2).finish, finished(&events, 2).n_gen), (Finish::Length, 10));
    assert_pages_back(&mut s);
}

#[test]
fn a_request_that_asks_sees_its_prefill_progress_chunk_by_chunk() {
    let m = tiny_model(1);
    let mut s = sched(&m, 1, 8);
    let mut r = req(1, prompt(20, 3), 2);
    r.progress = true;
    assert!(s.submit(r).unwrap());
    assert!(s.submit(req(2, prompt(20, 3), 2)).unwrap()); // did not ask: no progress events
    let events = run(&mut s);
    let p: Vec<(usize, usize, usize)> = events.iter().filter(|e| e.kind == EventKind::Progress).map(|e| (e.id as usize, e.n_gen, e.n_prompt)).collect();
    // Before the first chunk, then after each of the three (8, 8, 4 rows); all before its first piece.
    assert_eq!(p, vec![(1, 0, 20), (1, 8, 20), (1, 16, 20), (1, 20, 20)]);
    let first_piece = events.iter().position(|e| e.id == 1 && e.kind == EventKind::Piece).unwrap();
    let last_progress = events.iter().rposition(|e| e.kind == EventKind::Progress).unwrap();
    assert!(last_progress < first_piece);
    assert_eq!(tokens_by_id(&events)[&1].len(), 2);
}
