//! The shader table and the push-constant blocks. `shaders/variants.txt` lists every module
//! once; `build.rs` turns it into the `Shader` enum and `MODULES` (each module's embedded
//! SPIR-V), and `scripts/build_shaders.sh` compiles the same list. Each shader's
//! `layout(push_constant)` block has a `#[repr(C)]` twin here, checked field by field against the
//! GLSL by the test at the end of this file.

include!(concat!(env!("OUT_DIR"), "/shader_table.rs"));

/// One compiled module: `shaders/spv/<name>.spv`, from `shaders/<source>.comp` with `define`.
pub struct Module {
    pub name: &'static str,
    pub source: &'static str,
    /// What `scripts/build_shaders.sh` compiled it with (the push-block test preprocesses with it).
    #[cfg_attr(not(test), allow(dead_code))]
    pub define: Option<&'static str>,
    pub spirv: &'static [u8],
}

impl Shader {
    /// The module, if the table compiles this shader.
    pub fn module(self) -> Option<&'static Module> {
        self.index().map(|i| &MODULES[i])
    }
}

/// Whether the weight-reading kernels (both matmuls and the row gather) read a block format.
pub fn reads_format(ty: crate::quant::GgmlType) -> bool {
    [Shader::MulMat(ty), Shader::MulMatRows(ty), Shader::GetRows(ty)].iter().all(|s| s.index().is_some())
}

/// The size of the push-constant range every pipeline layout declares (Vulkan's guaranteed minimum).
pub const PUSH_BYTES: u32 = 128;

/// A push-constant value as the shaders take it (32 bits): a count or index that does not fit is
/// a bug upstream, not something to truncate.
pub fn u(v: usize) -> u32 {
    u32::try_from(v).unwrap_or_else(|_| panic!("push constant {v} does not fit 32 bits"))
}

/// One field of a push block: its name (the GLSL member's), its Rust type and its byte offset.
#[cfg(test)]
#[derive(Debug)]
pub struct Field {
    pub name: &'static str,
    pub ty: &'static str,
    pub offset: usize,
}

/// A shader's push-constant block: plain old data (no implicit padding: `bytemuck::Pod` refuses
/// it, so padding is a `_pad` field) in the GLSL block's order.
pub trait PushBlock: bytemuck::Pod {
    /// The sources (`shaders/<source>.comp`) declaring this block.
    const SOURCES: &'static [&'static str];
    #[cfg(test)]
    const FIELDS: &'static [Field];
}

macro_rules! push_blocks {
    ($($(#[$m:meta])* $name:ident for [$($src:literal),+] { $($field:ident: $ty:ty),* $(,)? })*) => {
        $(
            $(#[$m])*
            #[repr(C)]
            #[derive(Clone, Copy, Debug, Default, bytemuck::Pod, bytemuck::Zeroable)]
            pub struct $name {
                $(pub $field: $ty),*
            }
            impl PushBlock for $name {
                const SOURCES: &'static [&'static str] = &[$($src),+];
                #[cfg(test)]
                const FIELDS: &'static [Field] =
                    &[$(Field { name: stringify!($field), ty: stringify!($ty), offset: std::mem::offset_of!($name, $field) }),*];
            }
            const _: () = assert!(std::mem::size_of::<$name>() <= PUSH_BYTES as usize);
        )*
        /// Every block: its sources, fields and size.
        #[cfg(test)]
        const BLOCKS: &[(&[&str], &[Field], usize)] =
            &[$((<$name as PushBlock>::SOURCES, <$name as PushBlock>::FIELDS, std::mem::size_of::<$name>())),*];
    };
}

push_blocks! {
    /// `mul_mat.comp`, `mul_mat_rows.comp`: `y[t][r] = w[r] . x[t]` over `n` activation rows.
    MulMatPush for ["mul_mat", "mul_mat_rows"] {
        w: u64, x: u64, y: u64,
        rows: u32, cols: u32, n: u32, row_words: u32, x_stride: u32, y_stride: u32, rows_per_z: u32, _pad: u32,
    }
    /// `get_rows.comp`: the rows `ids` of a weight, dequantized and scaled.
    GetRowsPush for ["get_rows"] {
        w: u64, out_: u64, ids: u64,
        cols: u32, row_words: u32, scale: f32, _pad: u32,
    }
    /// `rms_norm.comp`.
    RmsNormPush for ["rms_norm"] {
        x: u64, w: u64, out_: u64,
        width: u32, eps: f32,
    }
    /// `rope.comp`: rotates `x` in place by the table `tab` (sine, cosine pairs per row).
    RopePush for ["rope"] {
        x: u64, tab: u64,
        width: u32, head_dim: u32, half_: u32, neox: u32, total: u32, _pad: u32,
    }
    /// `eltwise.comp`: `op` on `x` in place, with `y`, the scalar `a` and the per-row values `z`
    /// (ops 11 and 12 only; 0 otherwise).
    EltwisePush for ["eltwise"] {
        x: u64, y: u64,
        count: u32, width: u32, op: u32, a: f32,
        z: u64,
    }
    /// `gather_rows.comp`: `dst[j] = src[idx[j]]`.
    GatherRowsPush for ["gather_rows"] {
        src: u64, dst: u64, idx: u64,
        width: u32, count: u32,
    }
    /// `given_rows.comp`: the rows `map` names take (or, with `add`, add) their given values.
    GivenRowsPush for ["given_rows"] {
        x: u64, map: u64, values: u64,
        width: u32, src_width: u32, src_off: u32, n: u32, add: u32, _pad: u32,
    }
    /// `round_act.comp`: activations rounded as a block format would store them.
    RoundActPush for ["round_act"] {
        x: u64, out_: u64,
        blocks: u32, mode: u32,
    }
    /// `kv_store.comp`: K and V rows encoded into their regions' slots.
    KvStorePush for ["kv_store"] {
        k: u64, v: u64, kv: u64, meta: u64, signs: u64,
        kvd: u32, n: u32, slot_off: u32, v_off: u32, head_dim: u32, rscale: f32,
    }
    /// `attention.comp`: each query row over its region's stored K/V; `sinks` (one logit per
    /// query head) joins each softmax where `has_sinks` is 1.
    AttentionPush for ["attention"] {
        q: u64, out_: u64, kv: u64, meta: u64, signs: u64,
        n_heads: u32, n_kv_heads: u32, head_dim: u32, window: u32,
        qmul: f32, smul: f32, softcap: f32,
        slot_off: u32, v_off: u32, row_words: u32, rscale: f32, _pad: u32,
        sinks: u64, has_sinks: u32, has_ends: u32, ends: u64,
    }
    /// `moe_route.comp`: rows of router logits to n_used (expert, weight) pairs each.
    MoeRoutePush for ["moe_route"] {
        logits: u64, out_: u64, bias: u64,
        n_expert: u32, n_used: u32, gating: u32, has_bias: u32, norm: u32, scale: f32,
    }
    /// `mul_mat_id.comp`, `mul_mat_id_rows.comp`: each slot's chosen expert's matmul row.
    MulMatIdPush for ["mul_mat_id", "mul_mat_id_rows"] {
        w: u64, x: u64, y: u64, ids: u64, bias: u64,
        rows: u32, cols: u32, n_used: u32, row_words: u32, x_stride_t: u32, x_stride_j: u32, y_stride: u32, has_bias: u32,
        rows_per_z: u32, _pad: u32,
    }
    /// `moe_combine.comp`: each row's experts' outputs, weighted, in expert order.
    MoeCombinePush for ["moe_combine"] {
        y: u64, ids: u64, out_: u64, scale: u64,
        width: u32, n_used: u32, count: u32, has_scale: u32,
    }
    /// `dn_conv.comp`: a DeltaNet layer's causal convolution over each session's rows.
    DnConvPush for ["dn_conv"] {
        qkv: u64, conv_w: u64, meta: u64, state: u64,
        cd: u32, kernel: u32,
    }
    /// `dn_recur.comp`, `dn_recur_rows.comp`: a DeltaNet layer's recurrence per value head and
    /// session.
    DnRecurPush for ["dn_recur", "dn_recur_rows"] {
        qkv: u64, beta: u64, alpha: u64, out_: u64, meta: u64, state: u64, dt_bias: u64, a: u64,
        hd: u32, n_k_heads: u32, n_v_heads: u32, tiled: u32, eps_n: f32, sqrt_n: f32, scale: f32, _pad: u32,
    }
    /// `copy_cols.comp`: columns of each row into another matrix's columns.
    CopyColsPush for ["copy_cols"] {
        src: u64, dst: u64,
        src_width: u32, src_col: u32, dst_width: u32, dst_col: u32, cols: u32, rows: u32,
    }
    /// `vit_attention.comp`: a vision tower's full attention, per head, over `n` rows of each;
    /// where `windowed`, `bounds` holds each row's window as [start, end).
    VitAttentionPush for ["vit_attention"] {
        q: u64, k: u64, v: u64, out_: u64, bounds: u64,
        n: u32, heads: u32, hd: u32, scale: f32, windowed: u32, _pad: u32,
    }
}

#[cfg(test)]
mod tests {
    //! The Rust push blocks against the GLSL ones: each module's source is preprocessed with the
    //! module's define (`#include`, `#if defined(..)`), its `layout(push_constant)` block parsed,
    //! and its members laid out by the block's rules (std430, the default for push constants, or
    //! `scalar`); the Rust struct must have the same members, in order, of matching types, at the
    //! same offsets, and the same size.
    use super::*;
    use std::collections::HashSet;
    use std::path::{Path, PathBuf};

    fn shaders_dir() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shaders")
    }

    /// `#include "x"` inlined and `#if/#ifdef/#ifndef/#elif/#else/#endif` resolved against the
    /// defined names (conditions: `defined(X)`, `!`, `&&`, `||`; anything else fails the test).
    fn preprocess(file: &str, defines: &HashSet<String>, out: &mut String) {
        let path = shaders_dir().join(file);
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        // Each open #if: (this branch is live, some branch was taken, the enclosing one is live).
        let mut stack: Vec<(bool, bool, bool)> = Vec::new();
        let live = |s: &Vec<(bool, bool, bool)>| s.last().is_none_or(|t| t.0);
        for line in text.lines() {
            let t = line.trim_start();
            let (word, rest) = t.split_once(char::is_whitespace).map(|(w, r)| (w, r.trim())).unwrap_or((t, ""));
            match word {
                "#if" | "#ifdef" | "#ifndef" => {
                    let outer = live(&stack);
                    let c = match word {
                        "#if" => condition(rest, defines),
                        "#ifdef" => defines.contains(rest),
                        _ => !defines.contains(rest),
                    };
                    stack.push((outer && c, c, outer));
                }
                "#elif" => {
                    let top = stack.last_mut().expect("#elif without #if");
                    let c = !top.1 && condition(rest, defines);
                    *top = (top.2 && c, top.1 || c, top.2);
                }
                "#else" => {
                    let top = stack.last_mut().expect("#else without #if");
                    *top = (top.2 && !top.1, true, top.2);
                }
                "#endif" => {
                    stack.pop().expect("#endif without #if");
                }
                "#include" if live(&stack) => preprocess(rest.trim_matches('"'), defines, out),
                _ if live(&stack) => {
                    out.push_str(line);
                    out.push('\n');
                }
                _ => {}
            }
        }
        assert!(stack.is_empty(), "{file}: unterminated #if");
    }

    fn condition(c: &str, defines: &HashSet<String>) -> bool {
        let c = c.trim();
        if let Some((a, b)) = c.split_once("||") {
            return condition(a, defines) || condition(b, defines);
        }
        if let Some((a, b)) = c.split_once("&&") {
            return condition(a, defines) && condition(b, defines);
        }
        if let Some(r) = c.strip_prefix('!') {
            return !condition(r, defines);
        }
        match c.strip_prefix("defined").map(|r| r.trim().trim_start_matches('(').trim_end_matches(')').trim()) {
            Some(name) => defines.contains(name),
            None => panic!("the push-block test's preprocessor does not read `#if {c}`"),
        }
    }

    /// The block's members as (name, GLSL type), and whether it is `scalar`-laid out.
    fn push_block(src: &str) -> (Vec<(String, String)>, bool) {
        let at = src.find("push_constant").expect("no push_constant block");
        let head = &src[src[..at].rfind("layout").unwrap()..];
        let open = head.find('{').unwrap();
        let qualifiers = &head[..head.find(')').unwrap()];
        assert!(!qualifiers.contains("offset"), "explicit offsets: teach this test `layout(offset = ..)`");
        let scalar = qualifiers.contains("scalar");
        let body = &head[open + 1..head.find('}').unwrap()];
        let mut members = Vec::new();
        for decl in body.split(';').map(str::trim).filter(|d| !d.is_empty()) {
            let words: Vec<&str> = decl.split_whitespace().collect();
            let (ty, names) = words.split_first().expect("a member");
            for name in names.join(" ").split(',') {
                let name = name.trim();
                assert!(!name.contains('['), "array member {name}: teach this test arrays");
                members.push((name.to_string(), ty.to_string()));
            }
        }
        (members, scalar)
    }

    /// Size and alignment of a member (std430 or scalar), and the Rust type that mirrors it.
    fn glsl_type(ty: &str, buffer_refs: &HashSet<String>, scalar: bool) -> (usize, usize, &'static str) {
        let (size, align, rust) = match ty {
            "uint" => (4, 4, "u32"),
            "int" => (4, 4, "i32"),
            "float" => (4, 4, "f32"),
            // A buffer reference is a 64-bit device address.
            t if buffer_refs.contains(t) => (8, 8, "u64"),
            t => panic!("push member type {t}: teach this test its layout"),
        };
        (size, if scalar { size.min(align) } else { align }, rust)
    }

    #[test]
    fn push_blocks_match_the_glsl() {
        let mut checked = HashSet::new();
        for s in Shader::ALL {
            let m = s.module().expect("every shader in ALL has a module");
            let defines: HashSet<String> = m.define.iter().map(|d| d.to_string()).collect();
            let mut src = String::new();
            preprocess(&format!("{}.comp", m.source), &defines, &mut src);
            let buffer_refs: HashSet<String> = src
                .match_indices("buffer_reference")
                .filter_map(|(i, _)| src[i..].split_once(")").and_then(|(_, r)| r.split_whitespace().nth(1)).map(str::to_string))
                .collect();
            let (members, scalar) = push_block(&src);
            let (mut glsl, mut end, mut max_align) = (Vec::new(), 0usize, 1usize);
            for (name, ty) in &members {
                let (size, align, rust) = glsl_type(ty, &buffer_refs, scalar);
                let offset = end.next_multiple_of(align);
                glsl.push((name.as_str(), rust, offset));
                end = offset + size;
                max_align = max_align.max(align);
            }
            let size = end.next_multiple_of(max_align);
            let blocks: Vec<_> = BLOCKS.iter().filter(|b| b.0.contains(&m.source)).collect();
            assert_eq!(blocks.len(), 1, "{}: one Rust push block must name source {:?}", m.name, m.source);
            let (_, fields, rust_size) = blocks[0];
            let rust: Vec<(&str, &str, usize)> = fields.iter().filter(|f| !f.name.starts_with("_pad")).map(|f| (f.name, f.ty, f.offset)).collect();
            assert_eq!(rust, glsl, "{} ({:?}): the Rust push block's fields (name, type, offset) against the GLSL's", m.name, m.define);
            assert_eq!(*rust_size, size, "{}: push block size", m.name);
            assert!(size <= PUSH_BYTES as usize, "{}: the push block overflows the layout's range", m.name);
            checked.insert(m.source);
        }
        for (sources, _, _) in BLOCKS {
            for s in *sources {
                assert!(checked.contains(s), "push block for {s}, which no module of the table compiles");
            }
        }
    }

    /// The table and its enum agree: every module reached from exactly one shader, its file
    /// present in `shaders/spv/` and nothing there that the table does not list.
    #[test]
    fn every_module_is_one_shader_and_one_file() {
        let mut seen = vec![false; MODULES.len()];
        for s in Shader::ALL {
            let i = s.index().unwrap();
            assert!(!std::mem::replace(&mut seen[i], true), "{s:?}: module {} reached twice", MODULES[i].name);
            assert!(MODULES[i].spirv.len() > 20 && MODULES[i].spirv[..4] == [0x03, 0x02, 0x23, 0x07], "{s:?}: not SPIR-V");
        }
        assert!(seen.iter().all(|&s| s), "a module no shader reaches");
        let names: HashSet<&str> = MODULES.iter().map(|m| m.name).collect();
        for e in std::fs::read_dir(shaders_dir().join("spv")).unwrap() {
            let f = e.unwrap().file_name().into_string().unwrap();
            let stem = f.strip_suffix(".spv").unwrap_or(&f);
            assert!(names.contains(stem), "shaders/spv/{f} is not in shaders/variants.txt");
        }
    }
}
