//! What Qwen3-VL's tower (llama.cpp's `clip_graph_qwen3vl`, projector type `qwen3vl_merger`)
//! adds to Qwen2-VL's (`qwen2vl`, which runs its layers): a patch bias and learned positions, a
//! square grid of them interpolated to the image's patches (ggml_interpolate, bilinear with
//! corners aligned) and taken in the tower's 2 x 2 block order; and "deepstack" mergers: after
//! each layer that has one, the layer's output, each block's four patches as one row of four
//! times the width, goes through a LayerNorm and a two-layer GELU MLP to the text width. An
//! image's row in the text model is the main merger's output followed by each deepstack's, in
//! layer order (clip.cpp's `n_mmproj_embd`: text width times 1 + deepstack count); the text model
//! adds slice k to the output of its layer k - 1 (`model::forward`, `Config::deepstack`).

use super::vit::{activate, layer_norm, matmul, norm, Norm, VitAct};
use super::{tensor_f32, VitConfig};
use crate::backend::HostOps;
use crate::model::TensorTable;
use crate::quant::Weight;
use crate::{Error, Result};

pub(crate) struct Deepstack {
    /// The tower layer whose output it reads.
    pub(super) layer: usize,
    /// Over a block's 4 * dim values.
    norm: Norm,
    fc1: Weight,
    fc1_b: Vec<f32>,
    fc2: Weight,
    fc2_b: Vec<f32>,
}

impl Deepstack {
    pub(crate) fn matrices(&self) -> [&Weight; 2] {
        [&self.fc1, &self.fc2]
    }
}

pub(crate) struct Qwen3vl {
    /// side * side rows of dim: the learned positions, row by row over their grid.
    pos: Vec<f32>,
    side: usize,
    pub(super) deepstack: Vec<Deepstack>,
}

impl Qwen3vl {
    /// The positions and the deepstack mergers (`v.deepstack.N.*`, N a tower layer, as llama.cpp
    /// finds them: by their tensors) of a tower of width `c.dim` over a text model of `text`.
    pub(crate) fn load(t: &TensorTable<'_>, c: &VitConfig, text: usize) -> Result<Qwen3vl> {
        let d = c.dim;
        let n = t.raw("v.position_embd.weight")?.rows;
        let side = (n as f64).sqrt().round() as usize;
        if side * side != n || side == 0 {
            return Err(Error::Gguf(format!("tensor 'v.position_embd.weight' has {n} rows; Qwen3-VL's positions are a square grid")));
        }
        let pos = tensor_f32(t, "v.position_embd.weight", &[d, n])?;
        let mut deepstack = Vec::new();
        for il in 0..c.n_layers {
            let name = |s: &str| format!("v.deepstack.{il}.{s}");
            if !t.has(&name("fc1.weight")) {
                continue;
            }
            let hidden = t.raw(&name("fc1.weight"))?.rows;
            deepstack.push(Deepstack {
                layer: il,
                norm: norm(t, &name("norm"), 4 * d, false)?,
                fc1: t.matrix(&name("fc1.weight"), hidden, 4 * d)?,
                fc1_b: t.vector(&name("fc1.bias"), hidden)?,
                fc2: t.matrix(&name("fc2.weight"), text, hidden)?,
                fc2_b: t.vector(&name("fc2.bias"), text)?,
            });
        }
        Ok(Qwen3vl { pos, side, deepstack })
    }

    /// The positions for gw x gh patches, row by row: the learned grid as it is where the image
    /// is its size, else interpolated as ggml_interpolate (bilinear, corners aligned) does it,
    /// in f32.
    pub(crate) fn positions(&self, d: usize, gw: usize, gh: usize) -> Vec<f32> {
        let s = self.side;
        if (gw, gh) == (s, s) {
            return self.pos.clone();
        }
        // ggml's scale factor per axis and the source coordinate of destination index i.
        let scale = |n: usize| if n > 1 && s > 1 { (n - 1) as f32 / (s - 1) as f32 } else { n as f32 / s as f32 };
        let taps = |i: usize, sf: f32| {
            let x = i as f32 / sf;
            let x0 = (x.floor() as isize).clamp(0, s as isize - 1) as usize;
            let x1 = (x0 + 1).min(s - 1);
            (x0, x1, (x - x0 as f32).clamp(0.0, 1.0))
        };
        let (sx, sy) = (scale(gw), scale(gh));
        let mut out = vec![0.0f32; gw * gh * d];
        for y in 0..gh {
            let (y0, y1, dy) = taps(y, sy);
            for x in 0..gw {
                let (x0, x1, dx) = taps(x, sx);
                let at = |yy: usize, xx: usize| &self.pos[(yy * s + xx) * d..(yy * s + xx + 1) * d];
                let (a, b, c, e) = (at(y0, x0), at(y0, x1), at(y1, x0), at(y1, x1));
                let row = &mut out[(y * gw + x) * d..(y * gw + x + 1) * d];
                for j in 0..d {
                    row[j] = a[j] * (1.0 - dx) * (1.0 - dy) + b[j] * dx * (1.0 - dy) + c[j] * (1.0 - dx) * dy + e[j] * dx * dy;
                }
            }
        }
        out
    }

    /// The text width of an image's row: the main merger's and each deepstack's.
    pub(crate) fn row_width(&self, text: usize) -> usize {
        text * (1 + self.deepstack.len())
    }
}

impl Deepstack {
    /// A layer's output `x` (4 * tokens rows of dim, each block's four patches consecutive) to
    /// tokens rows of the text width.
    pub(crate) fn forward(&self, ops: &mut dyn HostOps, x: &[f32], tokens: usize, eps: f32) -> Vec<f32> {
        let mut h = x.to_vec();
        layer_norm(&mut h, &self.norm, eps);
        let mut mid = vec![0.0f32; tokens * self.fc1.rows];
        matmul(ops, &mut [(&self.fc1, &mut mid)], &h, tokens);
        ops.add_bias(&mut mid, &self.fc1_b);
        activate(&mut mid, VitAct::Gelu);
        let mut out = vec![0.0f32; tokens * self.fc2.rows];
        matmul(ops, &mut [(&self.fc2, &mut out)], &mid, tokens);
        ops.add_bias(&mut out, &self.fc2_b);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grid(side: usize, d: usize) -> Qwen3vl {
        // Position (y, x) holds (y, x * 10) in its two values.
        let pos = (0..side * side).flat_map(|i| [(i / side) as f32, (i % side) as f32 * 10.0]).collect::<Vec<_>>();
        assert_eq!(pos.len(), side * side * d);
        Qwen3vl { pos, side, deepstack: Vec::new() }
    }

    #[test]
    fn positions_interpolate_with_corners_aligned() {
        let g = grid(3, 2);
        assert_eq!(g.positions(2, 3, 3), g.pos);
        // 5 wide, 2 high from 3 x 3: corners stay, columns at halves, rows at the two ends.
        let p = g.positions(2, 5, 2);
        let rows: Vec<(f32, f32)> = p.chunks_exact(2).map(|v| (v[0], v[1])).collect();
        assert_eq!(rows[..5], [(0.0, 0.0), (0.0, 5.0), (0.0, 10.0), (0.0, 15.0), (0.0, 20.0)]);
        assert_eq!(rows[5..], [(2.0, 0.0), (2.0, 5.0), (2.0, 10.0), (2.0, 15.0), (2.0, 20.0)]);
    }
}
