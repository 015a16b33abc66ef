//! Prompt lookup: the conversation so far often repeats itself (a summary quotes its source, an
//! edit rewrites code it was shown), so what followed the last occurrence of the context's tail
//! is a cheap guess at what comes next. No model, no state: a scan of the stream's own tokens.

/// The longest tail tried first: longer matches are rarer but far more often right.
const MAX_N: usize = 4;
/// Shorter tails match too often by chance (a single space, a comma) to be worth a verify row.
const MIN_N: usize = 2;

/// Up to `max` tokens that followed the most recent earlier occurrence of `ctx`'s last n tokens
/// (n from 4 down to 2), appended to `out`. Nothing when no tail recurs.
pub fn propose(ctx: &[u32], max: usize, out: &mut Vec<u32>) {
    let len = ctx.len();
    for n in (MIN_N..=MAX_N.min(len.saturating_sub(1))).rev() {
        let tail = &ctx[len - n..];
        // Most recent first: the freshest context is the likeliest to continue the same way.
        if let Some(at) = (0..len - n).rev().find(|&i| ctx[i..i + n] == *tail) {
            let from = at + n;
            out.extend_from_slice(&ctx[from..len.min(from + max)]);
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::propose;

    fn run(ctx: &[u32], max: usize) -> Vec<u32> {
        let mut out = Vec::new();
        propose(ctx, max, &mut out);
        out
    }

    #[test]
    fn the_longest_most_recent_match_proposes_what_followed() {
        // "7 8 9" recurs twice; the later occurrence (followed by 5) wins over the earlier (by 1).
        assert_eq!(run(&[7, 8, 9, 1, 2, 7, 8, 9, 5, 6, 0, 7, 8, 9], 8), vec![5, 6, 0, 7, 8, 9]);
        assert_eq!(run(&[7, 8, 9, 1, 2, 7, 8, 9, 5, 6, 0, 7, 8, 9], 2), vec![5, 6]);
        // A 4-token match beats a more recent 2-token one.
        assert_eq!(run(&[1, 2, 3, 4, 10, 11, 3, 4, 20, 1, 2, 3, 4], 1), vec![10]);
        // Tails of one token, or no recurrence: nothing.
        assert!(run(&[1, 2, 3, 1], 4).is_empty());
        assert!(run(&[1, 2, 3, 4, 5], 4).is_empty());
        assert!(run(&[], 4).is_empty());
        assert!(run(&[5, 5], 4).is_empty());
        // A run of one token proposes itself.
        assert_eq!(run(&[5, 5, 5, 5, 5], 3), vec![5]);
    }
}
