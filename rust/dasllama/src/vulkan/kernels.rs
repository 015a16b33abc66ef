//! The compute pipelines (SPIR-V compiled from `shaders/` by `scripts/build_shaders.sh` and
//! embedded: the table in `shaders.rs`) and the command buffers steps record into: dispatches with push constants,
//! barriers, copies, then submit and wait. A step's chain can be kept (`record_chain` / `keep`)
//! and replayed: buffers are reached by addresses fixed at upload, so a chain recorded for one
//! shape of step serves every later step of that shape once its metadata buffer is rewritten.

use super::buffer::Buffer;
use super::device::{vk_err, Gpu};
use super::shaders::{PushBlock, Shader, PUSH_BYTES};
use crate::{Error, Result};
use ash::vk;
use std::sync::Arc;

/// Pipelines, made on first use (a driver compiles each one, which takes a while on lavapipe).
pub struct Kernels {
    gpu: Arc<Gpu>,
    layout: vk::PipelineLayout,
    /// By `Shader::index`.
    pipelines: Vec<Option<vk::Pipeline>>,
}

impl Kernels {
    pub fn new(gpu: &Arc<Gpu>) -> Result<Kernels> {
        let ranges = [vk::PushConstantRange::default().stage_flags(vk::ShaderStageFlags::COMPUTE).size(PUSH_BYTES)];
        let info = vk::PipelineLayoutCreateInfo::default().push_constant_ranges(&ranges);
        // SAFETY: valid create info; destroyed in Drop.
        let layout = unsafe { gpu.device.create_pipeline_layout(&info, None) }.map_err(vk_err("creating the pipeline layout"))?;
        Ok(Kernels { gpu: gpu.clone(), layout, pipelines: vec![None; super::shaders::MODULES.len()] })
    }

    /// The pipeline of `shader` (an error only for a value the table does not compile, which
    /// `shaders::reads_format` tells beforehand, or a driver failing to compile it).
    pub fn get(&mut self, shader: Shader) -> Result<vk::Pipeline> {
        let i = shader.index().ok_or_else(|| Error::Internal(format!("no shader {shader:?} (shaders/variants.txt does not list it)")))?;
        if let Some(p) = self.pipelines[i] {
            return Ok(p);
        }
        let name = super::shaders::MODULES[i].name;
        let code =
            ash::util::read_spv(&mut std::io::Cursor::new(super::shaders::MODULES[i].spirv)).map_err(|e| Error::Internal(format!("shader {name}: {e}")))?;
        let d = &self.gpu.device;
        // SAFETY: `code` is SPIR-V validated by spirv-val at build time.
        let module = unsafe { d.create_shader_module(&vk::ShaderModuleCreateInfo::default().code(&code), None) }.map_err(vk_err("loading a shader"))?;
        let stage = vk::PipelineShaderStageCreateInfo::default().stage(vk::ShaderStageFlags::COMPUTE).module(module).name(c"main");
        let info = [vk::ComputePipelineCreateInfo::default().stage(stage).layout(self.layout)];
        // SAFETY: valid create info; the module may be destroyed once the pipeline exists.
        let made = unsafe { d.create_compute_pipelines(vk::PipelineCache::null(), &info, None) };
        // SAFETY: the module is not used after pipeline creation.
        unsafe { d.destroy_shader_module(module, None) };
        let p = made.map_err(|(_, e)| vk_err("compiling a compute pipeline")(e))?[0];
        self.pipelines[i] = Some(p);
        Ok(p)
    }
}

impl Drop for Kernels {
    fn drop(&mut self) {
        // SAFETY: no command buffer using these pipelines is pending (every submit is waited for).
        unsafe {
            for &p in self.pipelines.iter().flatten() {
                self.gpu.device.destroy_pipeline(p, None);
            }
            self.gpu.device.destroy_pipeline_layout(self.layout, None);
        }
    }
}

/// Largest workgroup count per dimension every device accepts.
const MAX_GROUPS: u32 = 65535;

/// A recorded chain kept for replay (freed with its runner's pool, or by `Runner::free`).
pub struct Chain(vk::CommandBuffer);

/// A one-shot command buffer, recorded per use, and chains kept for replay; every submission
/// is waited for (its fence) before it returns: nothing a step used can be freed while the
/// device still reads it.
pub struct Runner {
    gpu: Arc<Gpu>,
    pool: vk::CommandPool,
    /// What dispatches record into: the one-shot buffer, or a chain being recorded.
    cmd: vk::CommandBuffer,
    one_shot: vk::CommandBuffer,
    fence: vk::Fence,
    recording: bool,
    pub dispatches: usize,
}

impl Runner {
    pub fn new(gpu: &Arc<Gpu>) -> Result<Runner> {
        let d = &gpu.device;
        let pi = vk::CommandPoolCreateInfo::default().queue_family_index(gpu.queue_family).flags(vk::CommandPoolCreateFlags::RESET_COMMAND_BUFFER);
        // SAFETY: valid create infos; all destroyed in Drop.
        unsafe {
            let pool = d.create_command_pool(&pi, None).map_err(vk_err("creating a command pool"))?;
            let ai = vk::CommandBufferAllocateInfo::default().command_pool(pool).level(vk::CommandBufferLevel::PRIMARY).command_buffer_count(1);
            let cmd = d.allocate_command_buffers(&ai).map_err(vk_err("allocating a command buffer"))?[0];
            let fence = d.create_fence(&vk::FenceCreateInfo::default(), None).map_err(vk_err("creating a fence"))?;
            Ok(Runner { gpu: gpu.clone(), pool, cmd, one_shot: cmd, fence, recording: false, dispatches: 0 })
        }
    }

    /// Whether the device is a CPU-type one (lavapipe), where kernels take their barrier-free forms.
    pub fn cpu_device(&self) -> bool {
        self.gpu.info.kind == "cpu"
    }

    fn begin(&mut self) -> Result<()> {
        if !self.recording {
            let bi = vk::CommandBufferBeginInfo::default().flags(vk::CommandBufferUsageFlags::ONE_TIME_SUBMIT);
            // SAFETY: the buffer is not pending (the last submit was waited for).
            unsafe {
                self.gpu.device.reset_command_buffer(self.cmd, vk::CommandBufferResetFlags::empty()).map_err(vk_err("resetting a command buffer"))?;
                self.gpu.device.begin_command_buffer(self.cmd, &bi).map_err(vk_err("recording a step"))?;
            }
            self.recording = true;
            self.dispatches = 0;
        }
        Ok(())
    }

    /// Dispatch `pipe` over `groups` workgroups (x may exceed the per-dimension limit: it wraps
    /// into y for kernels written for that, or z for the matmul's rows).
    pub fn dispatch<P: PushBlock>(&mut self, k: &mut Kernels, shader: Shader, push: P, groups: [u32; 3]) -> Result<()> {
        let pipe = k.get(shader)?;
        let source = shader.module().expect("get found it").source;
        assert!(P::SOURCES.contains(&source), "{shader:?} ({source}.comp) does not take the push block {}", std::any::type_name::<P>());
        self.begin()?;
        let d = &self.gpu.device;
        // SAFETY: recording; the pipeline and layout are live; the push range covers the bytes.
        unsafe {
            d.cmd_bind_pipeline(self.cmd, vk::PipelineBindPoint::COMPUTE, pipe);
            d.cmd_push_constants(self.cmd, k.layout, vk::ShaderStageFlags::COMPUTE, 0, bytemuck::bytes_of(&push));
            d.cmd_dispatch(self.cmd, groups[0], groups[1], groups[2]);
        }
        self.dispatches += 1;
        Ok(())
    }

    /// 1-D dispatch of `count` invocations of a 64-wide kernel that wraps its index into y.
    pub fn dispatch_flat<P: PushBlock>(&mut self, k: &mut Kernels, shader: Shader, push: P, count: usize) -> Result<()> {
        let groups = count.div_ceil(64).max(1) as u32;
        let (x, y) = if groups > MAX_GROUPS { (MAX_GROUPS, groups.div_ceil(MAX_GROUPS)) } else { (groups, 1) };
        self.dispatch(k, shader, push, [x, y, 1])
    }

    /// Every earlier dispatch's writes are visible to every later one.
    pub fn barrier(&mut self) -> Result<()> {
        self.begin()?;
        let mb = [vk::MemoryBarrier::default()
            .src_access_mask(vk::AccessFlags::SHADER_WRITE | vk::AccessFlags::TRANSFER_WRITE)
            .dst_access_mask(vk::AccessFlags::SHADER_READ | vk::AccessFlags::SHADER_WRITE | vk::AccessFlags::TRANSFER_READ)];
        let stages = vk::PipelineStageFlags::COMPUTE_SHADER | vk::PipelineStageFlags::TRANSFER;
        // SAFETY: recording.
        unsafe { self.gpu.device.cmd_pipeline_barrier(self.cmd, stages, stages, vk::DependencyFlags::empty(), &mb, &[], &[]) };
        Ok(())
    }

    /// Zero `size` bytes of `dst` from `off`.
    pub fn zero(&mut self, dst: &Buffer, off: u64, size: u64) -> Result<()> {
        self.begin()?;
        // SAFETY: recording; the buffer is live and the range lies inside it (callers size it).
        unsafe { self.gpu.device.cmd_fill_buffer(self.cmd, dst.raw, off, size, 0) };
        Ok(())
    }

    pub fn copy(&mut self, src: &Buffer, src_off: u64, dst: &Buffer, dst_off: u64, size: u64) -> Result<()> {
        self.begin()?;
        let r = [vk::BufferCopy { src_offset: src_off, dst_offset: dst_off, size }];
        // SAFETY: recording; both buffers are live and the ranges lie inside them (callers size them).
        unsafe { self.gpu.device.cmd_copy_buffer(self.cmd, src.raw, dst.raw, &r) };
        Ok(())
    }

    /// Record what follows into a new chain to keep (`keep` ends it), instead of the one-shot
    /// buffer. Anything recorded but not submitted is submitted first.
    pub fn record_chain(&mut self) -> Result<()> {
        self.submit()?;
        let ai = vk::CommandBufferAllocateInfo::default().command_pool(self.pool).level(vk::CommandBufferLevel::PRIMARY).command_buffer_count(1);
        let bi = vk::CommandBufferBeginInfo::default();
        // SAFETY: the pool is live; the new buffer is in the initial state.
        unsafe {
            self.cmd = self.gpu.device.allocate_command_buffers(&ai).map_err(vk_err("allocating a command buffer"))?[0];
            self.gpu.device.begin_command_buffer(self.cmd, &bi).map_err(vk_err("recording a step"))?;
        }
        self.recording = true;
        self.dispatches = 0;
        Ok(())
    }

    /// End the chain `record_chain` started; later dispatches go to the one-shot buffer again.
    pub fn keep(&mut self) -> Result<Chain> {
        assert!(self.recording && self.cmd != self.one_shot, "keep without record_chain");
        let c = Chain(self.cmd);
        (self.cmd, self.recording) = (self.one_shot, false);
        // SAFETY: the chain is in the recording state.
        unsafe { self.gpu.device.end_command_buffer(c.0) }.map_err(vk_err("recording a step"))?;
        Ok(c)
    }

    /// Drop a chain whose recording failed part way; later dispatches go to the one-shot buffer.
    pub fn abandon(&mut self) {
        if self.cmd != self.one_shot {
            let c = Chain(self.cmd);
            (self.cmd, self.recording) = (self.one_shot, false);
            // SAFETY: the chain was never submitted.
            unsafe {
                let _ = self.gpu.device.end_command_buffer(c.0);
            }
            self.free(c);
        }
    }

    /// Run a kept chain and wait for it.
    pub fn replay(&mut self, c: &Chain) -> Result<()> {
        self.submit()?;
        self.run(c.0)
    }

    /// Free a kept chain.
    pub fn free(&mut self, c: Chain) {
        // SAFETY: nothing is pending (every submission is waited for); the chain came from this pool.
        unsafe { self.gpu.device.free_command_buffers(self.pool, &[c.0]) };
    }

    /// Submit what was recorded and wait for it.
    pub fn submit(&mut self) -> Result<()> {
        if !self.recording {
            return Ok(());
        }
        assert!(self.cmd == self.one_shot, "a chain is being recorded: keep it first");
        self.recording = false;
        // SAFETY: the one-shot buffer is in the recording state.
        unsafe { self.gpu.device.end_command_buffer(self.cmd) }.map_err(vk_err("recording a step"))?;
        self.run(self.cmd)
    }

    fn run(&mut self, cmd: vk::CommandBuffer) -> Result<()> {
        let d = &self.gpu.device;
        let cmds = [cmd];
        let si = [vk::SubmitInfo::default().command_buffers(&cmds)];
        // SAFETY: the buffer was recorded on this device and ended; the fence is unsignalled; we
        // wait for it before touching anything the step used.
        unsafe {
            let q = self.gpu.queue_lock.lock().unwrap_or_else(|e| e.into_inner());
            d.queue_submit(self.gpu.queue, &si, self.fence).map_err(vk_err("submitting a step"))?;
            drop(q);
            let waited = d.wait_for_fences(&[self.fence], true, u64::MAX);
            d.reset_fences(&[self.fence]).map_err(vk_err("resetting a fence"))?;
            waited.map_err(vk_err("running a step"))?;
        }
        #[cfg(feature = "fault-injection")]
        if self.gpu.fault.swap(false, std::sync::atomic::Ordering::SeqCst) {
            return Err(super::device::vk_err("running a step")(vk::Result::ERROR_DEVICE_LOST));
        }
        Ok(())
    }
}

impl Drop for Runner {
    fn drop(&mut self) {
        // SAFETY: nothing is pending (submit waits); destroying the pool frees its buffer.
        unsafe {
            self.gpu.device.destroy_fence(self.fence, None);
            self.gpu.device.destroy_command_pool(self.pool, None);
        }
    }
}
