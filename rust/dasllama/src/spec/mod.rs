//! Speculative decoding. A drafter proposes a stream's next few tokens; the target evaluates the
//! stream's next token and the k drafts as one chunk with logits after every row (the same
//! arithmetic as decoding them one at a time), and the stream keeps the drafts the target agrees
//! with plus one token of the target's own. Agreement is decided by sampling from the target's
//! own row with the stream's own sampler and comparing: every drafter here proposes single tokens
//! (a point mass), for which that rule is exactly speculative sampling's accept/resample rule,
//! and since each row and the sampler's state are what plain decoding would have had, a stream's
//! output does not depend on whether it speculated, sampled or greedy. Rejected rows are taken
//! back: the KV is truncated to the accepted length, the token record never saw them.

pub mod assistant;
pub mod draft;
pub mod mtp;
pub mod ngram;
pub mod policy;

use crate::model::{Assistant, Model, MtpHead};
use crate::session::Session;
use crate::{Error, Result};
use std::sync::Arc;

/// More drafts than this per step are never accepted often enough to pay for their rows.
pub const MAX_DRAFT: usize = 32;

/// What proposes a stream's drafts.
#[derive(Clone)]
pub enum Drafter {
    /// Prompt lookup over the stream's own tokens (`ngram`): no model.
    Ngram { max_draft: usize },
    /// A draft model with the target's vocabulary, decoding greedily (`draft`).
    Model { draft: Arc<Model>, max_draft: usize },
    /// The target's own MTP head (in its file or a sidecar), chained greedily (`mtp`).
    Mtp { head: Arc<MtpHead>, max_draft: usize },
    /// Gemma 4's assistant drafter (a sidecar), chained greedily over the target's K/V (`mtp`).
    Assistant { asst: Arc<Assistant>, max_draft: usize },
}

fn check_max_draft(max_draft: usize) -> Result<()> {
    if !(1..=MAX_DRAFT).contains(&max_draft) {
        return Err(Error::InvalidArgument(format!("max_draft is {max_draft}; it must be between 1 and {MAX_DRAFT}")));
    }
    Ok(())
}

impl Drafter {
    pub fn ngram(max_draft: usize) -> Result<Drafter> {
        check_max_draft(max_draft)?;
        Ok(Drafter::Ngram { max_draft })
    }

    /// A draft model for `target`; Ok(Err(reason)) when its tokens do not mean the target's.
    pub fn model(target: &Model, draft: Arc<Model>, max_draft: usize) -> Result<std::result::Result<Drafter, String>> {
        check_max_draft(max_draft)?;
        if let Some(why) = target.tokenizer.vocab_difference(&draft.tokenizer) {
            return Ok(Err(why));
        }
        if target.config.vocab_size != draft.config.vocab_size {
            return Ok(Err(format!("the output layers have {} and {} rows", target.config.vocab_size, draft.config.vocab_size)));
        }
        Ok(Ok(Drafter::Model { draft, max_draft }))
    }

    /// The MTP head `head` (made for `target`: `MtpHead::sidecar` checked it, or it is the
    /// target's own).
    pub fn mtp(head: Arc<MtpHead>, max_draft: usize) -> Result<Drafter> {
        check_max_draft(max_draft)?;
        Ok(Drafter::Mtp { head, max_draft })
    }

    /// Gemma 4's assistant `asst` (made for `target`: `Assistant::sidecar` checked it).
    pub fn assistant(asst: Arc<Assistant>, max_draft: usize) -> Result<Drafter> {
        check_max_draft(max_draft)?;
        Ok(Drafter::Assistant { asst, max_draft })
    }

    pub fn max_draft(&self) -> usize {
        match self {
            Drafter::Ngram { max_draft } | Drafter::Model { max_draft, .. } | Drafter::Mtp { max_draft, .. } | Drafter::Assistant { max_draft, .. } => {
                *max_draft
            }
        }
    }

    /// Whether its drafts are right in bursts rather than at a steady rate. Prompt lookup is (a
    /// conversation drifts between quoting its context and writing anew); a draft model or an
    /// MTP head agrees with the target at a rate that belongs to the pair and drifts slowly.
    pub fn bursty(&self) -> bool {
        matches!(self, Drafter::Ngram { .. })
    }

    pub fn kind(&self) -> &'static str {
        match self {
            Drafter::Ngram { .. } => "ngram",
            Drafter::Model { .. } => "draft",
            Drafter::Mtp { .. } | Drafter::Assistant { .. } => "mtp",
        }
    }
}

/// One stream's speculation state.
pub struct StreamSpec {
    /// Decayed counts of a step's first drafts accepted and judged.
    first: Rate,
    /// The same for the drafts after an accepted one (a rejected one ends a run). Kept apart
    /// from the first: acceptance comes in runs (a quote either continues or it does not), so
    /// a draft that follows an accepted one is far likelier right than a step's first is.
    then: Rate,
    /// The draft model's session for this stream, made on its first draft.
    pub draft: Option<Session>,
    /// The MTP head's state for this stream, made at admission (it follows the whole context).
    pub mtp: Option<mtp::MtpStream>,
    /// For Gemma 4's assistant: the target's hidden state (after its final norm) at the last
    /// position its K/V holds, or empty where it is not known.
    pub last_h: Vec<f32>,
    /// This step's drafts.
    pub drafts: Vec<u32>,
    /// How much of its estimates the stream keeps at each judged step (`BURSTY_FORGET` or
    /// `STEADY_FORGET`).
    forget: f64,
}

/// Acceptance is re-estimated as the stream goes, at a pace that suits the drafter (`bursty`):
/// prompt lookup's estimates follow the last few steps; a model's average over a few dozen, so
/// that a short unlucky run does not switch off a drafter that pays on average (at 64%
/// acceptance a Q4_0 draft for its F16 original sat idle four steps in ten with the quick
/// estimate, and delivered 1.10x where drafting every step gave 1.24x).
const BURSTY_FORGET: f64 = 0.7;
const STEADY_FORGET: f64 = 0.95;

/// The prior: one accepted draft in two judged, worth a first try at one stream.
const PRIOR: (f64, f64) = (1.0, 2.0);
/// How fast a stream that stopped drafting drifts back to the prior, so that it tries again.
const IDLE_FORGET: f64 = 0.9;

/// Decayed counts of drafts accepted and judged.
#[derive(Clone, Copy)]
struct Rate {
    accepted: f64,
    judged: f64,
}

impl Rate {
    const PRIOR: Rate = Rate { accepted: PRIOR.0, judged: PRIOR.1 };

    fn value(self) -> f64 {
        self.accepted / self.judged
    }

    fn add(&mut self, accepted: usize, judged: usize, forget: f64) {
        self.accepted = self.accepted * forget + accepted as f64;
        self.judged = self.judged * forget + judged as f64;
    }

    fn relax(&mut self) {
        self.accepted = self.accepted * IDLE_FORGET + PRIOR.0 * (1.0 - IDLE_FORGET);
        self.judged = self.judged * IDLE_FORGET + PRIOR.1 * (1.0 - IDLE_FORGET);
    }
}

impl Default for StreamSpec {
    /// No drafter: the estimates are never read.
    fn default() -> Self {
        StreamSpec { first: Rate::PRIOR, then: Rate::PRIOR, draft: None, mtp: None, last_h: Vec::new(), drafts: Vec::new(), forget: BURSTY_FORGET }
    }
}

impl StreamSpec {
    /// A new stream's state under a drafter (`Drafter::bursty`), with the MTP head's state when
    /// the drafter is one.
    pub fn new(bursty: bool, mtp: Option<mtp::MtpStream>) -> StreamSpec {
        StreamSpec { mtp, forget: if bursty { BURSTY_FORGET } else { STEADY_FORGET }, ..StreamSpec::default() }
    }

    /// The estimated chances that a step's first draft is accepted, and that a draft after an
    /// accepted one is.
    pub fn acceptance(&self) -> (f64, f64) {
        (self.first.value(), self.then.value())
    }

    /// The stream could have drafted but was not worth it this step. Its estimates would never
    /// change without drafts, so they relax towards the prior: a stream that stopped quoting its
    /// context may have started again.
    pub fn idle(&mut self) {
        self.first.relax();
        self.then.relax();
    }

    /// `proposed` drafts were verified and the first `accepted` of them kept.
    pub fn observe(&mut self, proposed: usize, accepted: usize) {
        if proposed == 0 {
            return;
        }
        self.first.add(usize::from(accepted > 0), 1, self.forget);
        if accepted > 0 && proposed > 1 {
            // The drafts after the first that were judged: the accepted ones, and the one that
            // ended the run if one did.
            self.then.add(accepted - 1, accepted - 1 + usize::from(accepted < proposed), self.forget);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::StreamSpec;

    #[test]
    fn a_draft_models_estimate_outlasts_a_short_unlucky_run_and_prompt_lookups_does_not() {
        let (mut quick, mut steady) = (StreamSpec::new(true, None), StreamSpec::new(false, None));
        // Two in three first drafts accepted for a long while, then three rejected in a row.
        for step in 0..60 {
            for s in [&mut quick, &mut steady] {
                s.observe(2, if step % 3 == 2 { 0 } else { 1 });
            }
        }
        for _ in 0..3 {
            quick.observe(2, 0);
            steady.observe(2, 0);
        }
        let (q, s) = (quick.acceptance().0, steady.acceptance().0);
        assert!(s > 0.5, "the steady estimate still says about two in three: {s}");
        assert!(q < 0.3, "prompt lookup's follows its last few steps: {q}");
    }

    #[test]
    fn acceptance_of_a_first_draft_and_of_the_ones_after_are_told_apart() {
        // A quoting stream: half its steps' first drafts fail, and the other half run all the
        // way (eight of eight).
        let mut s = StreamSpec::default();
        for step in 0..40 {
            if step % 2 == 0 {
                s.observe(8, 0);
            } else {
                s.observe(8, 8);
            }
        }
        let (first, then) = s.acceptance();
        assert!((first - 0.5).abs() < 0.15, "{first}");
        assert!(then > 0.95, "{then}");
        // Runs that stop after one: the drafts after the first are judged wrong.
        for _ in 0..40 {
            s.observe(4, 1);
        }
        let (first, then) = s.acceptance();
        assert!(first > 0.95 && then < 0.05, "{first} {then}");
        // Nothing drafted: nothing learnt.
        s.observe(0, 0);
        assert_eq!(s.acceptance(), (first, then));
    }
}
