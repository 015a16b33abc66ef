//! A gated DeltaNet layer as the backends take it: its geometry (from the family's metadata) and
//! its per-head parameters beside each session's recurrent state. The skeleton hands both to
//! `Ops::delta_net`; the CPU's kernel is `cpu::deltanet`.

/// Which key head a value head of a DeltaNet layer reads (there are `n_v / n_k` value heads per
/// key head). The two families order their value heads differently.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HeadMap {
    /// Value head j reads key head j / (n_v / n_k): each key head's value heads are adjacent
    /// (qwen3next).
    Grouped,
    /// Value head j reads key head j % n_k (qwen35).
    Tiled,
}

/// A gated DeltaNet layer (qwen35, qwen3next): one projection gives the channels Q, K and V
/// (`attn_qkv`), which run through a causal depthwise convolution of `conv_kernel` taps
/// (`ssm_conv1d`) and SiLU; Q and K heads are L2-normalised; each value head keeps a
/// `head_dim` x `head_dim` state S that decays by exp(g) each token (g = softplus(alpha +
/// `ssm_dt.bias`) * `ssm_a`, alpha a projection of the input) and takes the delta rule's update
/// with strength beta (the sigmoid of another projection); the output S^T q is RMS-normed per head
/// (`ssm_norm`), gated by SiLU of a third projection (`attn_gate`), and projected back (`ssm_out`).
/// The convolution's last `conv_kernel - 1` inputs and every head's S are the layer's recurrent
/// state, kept per session beside its K/V pages.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DeltaNet {
    pub conv_kernel: usize,
    pub n_k_heads: usize,
    pub n_v_heads: usize,
    /// Size of every key and value head (`ssm.state_size`).
    pub head_dim: usize,
    pub k_of_v: HeadMap,
    /// Beta and alpha come from one projection `ssm_ba` (per key head: its value heads' betas,
    /// then their alphas; qwen3next) instead of `ssm_beta` and `ssm_alpha` (qwen35).
    pub fused_ba: bool,
    /// Epsilon of the L2 norms of Q and K (the model's RMS-norm epsilon).
    pub eps: f32,
}

impl DeltaNet {
    pub fn key_dim(&self) -> usize {
        self.n_k_heads * self.head_dim
    }
    pub fn value_dim(&self) -> usize {
        self.n_v_heads * self.head_dim
    }
    /// Channels of the convolution: Q, K and V.
    pub fn conv_dim(&self) -> usize {
        2 * self.key_dim() + self.value_dim()
    }
    /// Floats of the convolution's state: its last `conv_kernel - 1` inputs.
    pub fn conv_state(&self) -> usize {
        (self.conv_kernel - 1) * self.conv_dim()
    }
    /// Floats of the recurrent state: one head_dim x head_dim matrix per value head.
    pub fn ssm_state(&self) -> usize {
        self.n_v_heads * self.head_dim * self.head_dim
    }
}

/// The layer's per-head parameters beside the state: the convolution (`conv_kernel` rows of
/// conv_dim, tap 0 oldest), and the decay's `ssm_dt.bias` and `ssm_a`.
pub struct DnParams<'a> {
    pub conv: &'a [f32],
    pub dt_bias: &'a [f32],
    pub a: &'a [f32],
}
