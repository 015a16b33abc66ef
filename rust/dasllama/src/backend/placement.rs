//! A model's place on a device: what the device holds for that one model (its weights, its K/V
//! regions), owned by the model and dropped with it. The model runs its passes through it: whole
//! passes over device-home sessions (`forward`, one dispatch chain per step on the Vulkan
//! driver), or host passes whose matrix products it takes (`host_pass`, the per-op rails).
//!
//! Nothing here is process-wide: each placement has its own locks, held only by that model's
//! passes, and a status snapshot it publishes after each step, so a status read or another
//! model's pass never waits behind a device step.

use super::{Act, MatmulOffload, Ops, PassIn};
use crate::kv::{Grid, Grids, KvCache, KvCodec};
use crate::quant::Weight;
use crate::{Error, Result};
use std::sync::{Arc, Weak};

/// A snapshot of what a placement holds and has done, published after each step.
#[derive(Clone, Debug, Default)]
pub struct PlacementStatus {
    /// "gpu:resident" (the whole pass on the device), "gpu:partial" (the first
    /// `resident_layers` layers on the device, the rest on the CPU) or "gpu:rails" (matrices only).
    pub tier: &'static str,
    /// The device's name.
    pub device: String,
    /// Why the device does not run the whole pass ("" while it does): the resident driver's
    /// reason to decline a rails model, or what ended the placement (a lost device).
    pub reason: String,
    /// False once the device failed under it: every later pass runs on the host.
    pub serving: bool,
    pub resident_layers: usize,
    pub weight_bytes: u64,
    pub kv_bytes: u64,
    /// Device K/V regions, positions per region and their codec (resident only).
    pub regions: usize,
    pub session_ctx: usize,
    pub codec: Option<KvCodec>,
    /// Device steps that recorded their dispatch chain, and those that replayed one.
    pub chains_recorded: u64,
    pub chains_replayed: u64,
}

pub trait Placement: Send + Sync {
    /// The snapshot of the last step (never waits for a running one).
    fn status(&self) -> PlacementStatus;

    /// Whether whole passes over device-home sessions run here (the resident driver, while
    /// its device answers).
    fn resident(&self) -> bool;

    /// A pass over host sessions: `f` runs it on the host, handing matrix products to the
    /// device where this placement holds them. A resident placement counts the pass as one the
    /// device did not serve (`cpu_passes`).
    fn host_pass(&self, f: &mut dyn FnMut(Option<&mut dyn MatmulOffload>));

    /// A device region for a new device-home session.
    fn create_kv(&self) -> Result<DevKv>;

    /// Rows, and rows with logits, one device pass takes at most: a longer call runs in windows.
    fn window(&self) -> (usize, usize);

    /// Whether `kv` is a session of this placement (and the placement still serves).
    fn owns(&self, kv: &DevKv) -> bool;

    /// Positions one device-home session holds.
    fn session_ctx(&self) -> usize;

    /// The layers a device pass runs when the device holds only the first of them (the rest run
    /// on the CPU, over the session's host K/V); None when it holds them all.
    fn split(&self) -> Option<usize> {
        None
    }

    /// One window of `m`'s forward pass over device-home sessions: session i of `inp` is the
    /// one in region `regions[i]`. The device runs `m.pass` on its ops (recording it the first
    /// time it sees this shape of window) and appends the rows the pass leaves to `out`.
    fn forward(&self, m: &dyn Placeable, regions: &[usize], inp: &PassIn<'_>, hidden: bool, out: &mut Vec<f32>) -> Result<()>;

    /// Copy a device-home session's rows into `host` (an empty host cache in the session's codec).
    fn hydrate(&self, kv: &DevKv, host: &mut KvCache) -> Result<()>;

    /// Every kind of pass that ran on the host while the device held the model, with its count.
    fn cpu_passes(&self) -> Vec<(u64, String)>;
}

/// A vision tower's place on a device (`vulkan::place_tower`): its matrices there, taking the
/// tower's matmuls and attention; everything else of the tower stays on the host. Owned by the
/// tower (`vision::Vision::place`) and dropped with it.
pub trait TowerPlacement: MatmulOffload + Send {
    fn status(&self) -> TowerStatus;
}

/// What a tower's device holds and has done.
#[derive(Clone, Debug, Default)]
pub struct TowerStatus {
    pub device: String,
    /// Matrices on the device, and those left on the host (over the budget, or in a form the
    /// device kernels do not read).
    pub matrices: usize,
    pub left_on_cpu: usize,
    pub weight_bytes: u64,
    /// Matmuls and attention calls the device ran.
    pub matmuls: u64,
    pub attentions: u64,
    /// Why the device stopped taking the tower's work (a lost device): the host runs it since.
    pub failed: Option<String>,
}

/// What a device needs of a model to place it: the model implements it, so a device knows the
/// pass's ops and the weights, never the model's types.
pub trait Placeable: Sync {
    /// The architecture's name, for messages.
    fn arch(&self) -> &str;
    /// Why the host alone runs this model (a summation order only the CPU reproduces), if so.
    fn host_only(&self) -> Option<String>;
    /// Every matrix, dense ones first (the per-op rails take them in this order while they fit).
    fn matrices(&self) -> Vec<&Weight>;
    /// The tables the pass reads by row (token embeddings), which go to the device beside the
    /// matrices.
    fn gathered(&self) -> Vec<&Weight>;
    /// Each K/V slot's heads: (head_dim, n_kv_heads).
    fn kv_heads(&self) -> Vec<(usize, usize)>;
    /// Each recurrent slot's layer (a hybrid's DeltaNet layers, in order; empty elsewhere).
    fn rec_layers(&self) -> Vec<super::DeltaNet>;
    fn seq_len(&self) -> usize;
    /// A pass's inputs for sessions at positions `lens` taking `counts` of `tokens`, the rows
    /// `picked` getting logits.
    fn pass_in<'a>(&self, lens: &[usize], counts: &'a [usize], tokens: &'a [u32], picked: Vec<usize>) -> PassIn<'a>;
    /// The forward pass's first `layers` layers on `b`; it returns what it leaves: logits, or the
    /// final hidden states where `hidden`, and every row's hidden state where `layers` stops
    /// before the last layer.
    fn pass(&self, b: &mut dyn Ops, inp: &PassIn<'_>, hidden: bool, layers: usize) -> Act;
    fn n_layers(&self) -> usize;
    /// Whether the layers can go to two devices, the first ones to this device: each layer
    /// keeps K/V of its own (in slot order), no per-layer inputs, no recurrent state.
    fn splits(&self) -> bool;
    /// Layer `il`'s matrices.
    fn layer_matrices(&self, il: usize) -> Vec<&Weight>;
}

/// Where a device-home session's region is booked: the placement's region table. A session
/// reaches it through a weak reference, so a placement that is gone (dropped, switched out,
/// lost) leaves its sessions stale instead of pointing them at another model's regions.
pub trait KvHome: Send + Sync {
    fn release(&self, region: usize);
    /// Keep `rows` of `region` for a later turn, with their images on M-RoPE axes; the claim
    /// names them.
    fn park(&self, region: usize, rows: usize, grids: Grids) -> u64;
    /// The region, row count and images `claim` names, now held; None when another stream took it.
    fn adopt(&self, claim: u64) -> Option<(usize, usize, Grids)>;
    /// Whether a claim's rows are taken whole or not at all: a region that holds a recurrent
    /// state after its last row cannot give a shorter prefix.
    fn whole(&self) -> bool {
        false
    }
}

/// A session's K/V in a device region.
pub struct DevKv {
    region: usize,
    len: usize,
    /// None once parked: the region is the table's again.
    home: Option<Weak<dyn KvHome>>,
    /// Images on M-RoPE axes in its rows (as a host cache keeps them).
    grids: Grids,
}

impl std::fmt::Debug for DevKv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DevKv").field("region", &self.region).field("len", &self.len).finish()
    }
}

fn stale() -> Error {
    Error::Device("this device session's model is no longer on the device (it was dropped, switched out, or the device was lost); create a new session".into())
}

impl DevKv {
    pub fn new(region: usize, home: Weak<dyn KvHome>) -> DevKv {
        DevKv { region, len: 0, home: Some(home), grids: Grids::default() }
    }

    pub fn region(&self) -> usize {
        self.region
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Forget positions from `pos` on (a speculative rollback): the rows stay but are
    /// overwritten by the next ones.
    pub fn truncate(&mut self, pos: usize) {
        self.len = self.len.min(pos);
        self.grids.truncate(self.len);
    }

    pub fn reset(&mut self) {
        self.len = 0;
        self.grids.clear();
    }

    /// Record an image on M-RoPE axes at its rows (`Grids::add`).
    pub fn add_grid(&mut self, g: Grid) {
        self.grids.add(g);
    }

    pub fn grids(&self) -> &Grids {
        &self.grids
    }

    /// After a pass wrote `n` more rows.
    pub fn advance(&mut self, n: usize) {
        self.len += n;
    }

    /// Whether this session's region is booked in `home` (and `home` is still there).
    pub fn is_in<H: KvHome + 'static>(&self, home: &Arc<H>) -> bool {
        self.home.as_ref().is_some_and(|w| std::ptr::addr_eq(w.as_ptr(), Arc::as_ptr(home)))
    }

    fn home(&self) -> Result<Arc<dyn KvHome>> {
        self.home.as_ref().and_then(Weak::upgrade).ok_or_else(stale)
    }

    /// Park a finished session's rows: its region is free for the next stream, and the claim
    /// names the rows until another stream takes the region. The session is left empty and
    /// holds no region; 0 when its placement is gone.
    pub fn park(&mut self) -> u64 {
        let Ok(home) = self.home() else { return 0 };
        let claim = home.park(self.region, self.len, std::mem::take(&mut self.grids));
        self.home = None;
        self.len = 0;
        claim
    }

    /// Hand the first `rows` rows a claim names to this fresh session (which gives up its own
    /// region). False when the claim is stale (another stream took the region) or holds fewer.
    pub fn adopt(&mut self, claim: u64, rows: usize) -> Result<bool> {
        let home = self.home()?;
        if self.len != 0 {
            return Err(Error::InvalidArgument("adopt needs a fresh device session (n_past 0)".into()));
        }
        let Some((region, held, mut grids)) = home.adopt(claim) else { return Ok(false) };
        if rows > held || (home.whole() && rows != held) {
            home.park(region, held, grids);
            return Ok(false);
        }
        home.release(self.region);
        self.region = region;
        self.len = rows;
        // The images in the rows taken place the rows this session adds after them.
        grids.truncate(rows);
        self.grids = grids;
        Ok(true)
    }
}

impl Drop for DevKv {
    fn drop(&mut self) {
        if let Some(home) = self.home.as_ref().and_then(Weak::upgrade) {
            home.release(self.region);
        }
    }
}
