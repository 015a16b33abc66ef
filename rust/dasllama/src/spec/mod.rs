//! Speculative decoding. A drafter proposes a stream's next few tokens; the target evaluates the
//! stream's next token and the k drafts as one chunk with logits after every row (the same
//! arithmetic as decoding them one at a time), and the stream keeps the drafts the target agrees
//! with plus one token of the target's own. Agreement is decided by sampling from the target's
//! own row with the stream's own sampler and comparing: every drafter here proposes single tokens
//! (a point mass), for which that rule is exactly speculative sampling's accept/resample rule,
//! and since each row and the sampler's state are what plain decoding would have had, a stream's
//! output does not depend on whether it speculated, sampled or greedy. Rejected rows are taken
//! back: the KV is truncated to the accepted length, the token record never saw them.

pub mod draft;
pub mod mtp;
pub mod ngram;
pub mod policy;

use crate::model::{Model, MtpHead};
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

    pub fn max_draft(&self) -> usize {
        match self {
            Drafter::Ngram { max_draft } | Drafter::Model { max_draft, .. } | Drafter::Mtp { max_draft, .. } => *max_draft,
        }
    }

    pub fn kind(&self) -> &'static str {
        match self {
            Drafter::Ngram { .. } => "ngram",
            Drafter::Model { .. } => "draft",
            Drafter::Mtp { .. } => "mtp",
        }
    }
}

/// One stream's speculation state.
pub struct StreamSpec {
    /// Decayed counts of accepted drafts and of drafts judged (a rejected one ends a run).
    accepted: f64,
    judged: f64,
    /// The draft model's session for this stream, made on its first draft.
    pub draft: Option<Session>,
    /// The MTP head's state for this stream, made at admission (it follows the whole context).
    pub mtp: Option<mtp::MtpStream>,
    /// This step's drafts.
    pub drafts: Vec<u32>,
}

/// Acceptance is re-estimated as the stream goes: a conversation drifts between quoting its
/// context and writing anew.
const ACCEPT_FORGET: f64 = 0.7;

/// The prior: one accepted draft in two judged, worth a first try at one stream.
const PRIOR: (f64, f64) = (1.0, 2.0);
/// How fast a stream that stopped drafting drifts back to the prior, so that it tries again.
const IDLE_FORGET: f64 = 0.9;

impl Default for StreamSpec {
    fn default() -> Self {
        StreamSpec { accepted: PRIOR.0, judged: PRIOR.1, draft: None, mtp: None, drafts: Vec::new() }
    }
}

impl StreamSpec {
    /// A new stream's state, with the MTP head's state when the drafter is one.
    pub fn with_mtp(mtp: Option<mtp::MtpStream>) -> StreamSpec {
        StreamSpec { mtp, ..StreamSpec::default() }
    }

    /// The estimated chance that the next draft is accepted, given the previous ones were.
    pub fn alpha(&self) -> f64 {
        self.accepted / self.judged
    }

    /// The stream could have drafted but was not worth it this step. Its estimate would never
    /// change without drafts, so it relaxes towards the prior: a stream that stopped quoting its
    /// context may have started again.
    pub fn idle(&mut self) {
        self.accepted = self.accepted * IDLE_FORGET + PRIOR.0 * (1.0 - IDLE_FORGET);
        self.judged = self.judged * IDLE_FORGET + PRIOR.1 * (1.0 - IDLE_FORGET);
    }

    /// `proposed` drafts were verified and the first `accepted` of them kept.
    pub fn observe(&mut self, proposed: usize, accepted: usize) {
        self.accepted = self.accepted * ACCEPT_FORGET + accepted as f64;
        self.judged = self.judged * ACCEPT_FORGET + accepted as f64 + if accepted < proposed { 1.0 } else { 0.0 };
    }
}
