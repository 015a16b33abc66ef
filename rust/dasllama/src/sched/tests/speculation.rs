//! Speculation in the scheduler: drafts from a draft model and from the prompt, verified by the
//! target in one pass.

use super::*;

#[test]
fn speculation_accepts_what_the_target_agrees_with_and_rejects_the_rest() {
    let m = tiny_model(7);
    let prompts = [prompt(12, 1), prompt(30, 2), prompt(5, 3)];
    let mut plain = sched(&m, 3, 64);
    for (i, p) in prompts.iter().enumerate() {
        plain.submit(req(i as i64, p.clone(), 24)).unwrap();
    }
    let want = tokens_by_id(&run(&mut plain));
    // The target as its own drafter: every draft is what the target samples.
    let mut same = sched(&m, 3, 64);
    same.set_drafter(Some(Drafter::model(&m, m.clone(), 4).unwrap().unwrap())).unwrap();
    same.fix_draft_len(Some(4)).unwrap();
    // Another model's drafts: mostly rejected.
    let mut other = sched(&m, 3, 64);
    other.set_drafter(Some(Drafter::model(&m, tiny_model(8), 4).unwrap().unwrap())).unwrap();
    other.fix_draft_len(Some(3)).unwrap();
    for s in [&mut same, &mut other] {
        for (i, p) in prompts.iter().enumerate() {
            s.submit(req(i as i64, p.clone(), 24)).unwrap();
        }
        let got = tokens_by_id(&run(s));
        assert_eq!(got, want, "speculation changed the output");
        assert!(s.stats.spec_drafted > 0, "{:?}", s.stats);
        assert!(s.stats.decode_steps < plain.stats.decode_steps || s.stats.spec_accepted < s.stats.spec_drafted, "{:?}", s.stats);
    }
    assert_eq!(same.stats.spec_accepted, same.stats.spec_drafted, "{:?}", same.stats);
    assert!(same.stats.decode_steps < plain.stats.decode_steps);
    assert!(other.stats.spec_accepted < other.stats.spec_drafted, "{:?}", other.stats);
    for s in [&mut plain, &mut same, &mut other] {
        assert_pages_back(s);
    }
}

#[test]
fn prompt_lookup_drafts_are_verified_like_any_other() {
    let m = tiny_model(9);
    // A repetitive prompt gives prompt lookup something to propose.
    let p: Vec<u32> = (0..48).map(|i| [5u32, 6, 7, 8][i % 4]).collect();
    let mut plain = sched(&m, 1, 64);
    plain.submit(req(1, p.clone(), 30)).unwrap();
    let want = tokens_by_id(&run(&mut plain));
    let mut s = sched(&m, 1, 64);
    s.set_drafter(Some(Drafter::ngram(4).unwrap())).unwrap();
    s.fix_draft_len(Some(4)).unwrap();
    s.submit(req(1, p, 30)).unwrap();
    assert_eq!(tokens_by_id(&run(&mut s)), want);
    assert!(s.stats.spec_accepted <= s.stats.spec_drafted);
    assert_pages_back(&mut s);
}

#[test]
fn no_drafts_while_a_prompt_waits_under_a_step_budget() {
    let m = tiny_model(9);
    let p = prompt(20, 1);
    let mut plain = sched(&m, 2, 64);
    for (id, p) in [(1, p.clone()), (2, prompt(120, 4))] {
        plain.submit(req(id, p, 40)).unwrap();
    }
    let want = tokens_by_id(&run(&mut plain));
    for budget in [Some(1e-9), None] {
        let mut s = sched(&m, 2, 64);
        s.set_drafter(Some(Drafter::model(&m, m.clone(), 4).unwrap().unwrap())).unwrap();
        s.fix_draft_len(Some(4)).unwrap();
        s.set_step_budget(budget);
        s.submit(req(1, p.clone(), 40)).unwrap();
        let mut events = Vec::new();
        // The first stream's prompt, then a few steps of it decoding (and drafting) alone.
        for _ in 0..8 {
            s.step(&mut events).unwrap();
        }
        assert!(s.stats.spec_drafted > 0, "{:?}", s.stats);
        s.submit(req(2, prompt(120, 4), 40)).unwrap();
        let (mut drafted_beside_prompt, mut prompt_steps) = (0, 0);
        while s.n_active() + s.n_queued() > 0 {
            let (drafted, fed) = (s.stats.spec_drafted, s.stats.prefill_tokens);
            s.step(&mut events).unwrap();
            if s.stats.prefill_tokens > fed {
                prompt_steps += 1;
                drafted_beside_prompt += s.stats.spec_drafted - drafted;
            }
        }
        assert!(prompt_steps > 1, "the second prompt took {prompt_steps} steps");
        // Under a budget the verify rows would take the prompt's place; with fixed chunks they
        // take nothing from it, so the stream drafts on.
        assert_eq!(drafted_beside_prompt == 0, budget.is_some(), "{drafted_beside_prompt} drafts beside the prompt (budget {budget:?})");
        assert_eq!(tokens_by_id(&events), want, "budget {budget:?}");
        assert_pages_back(&mut s);
    }
}
