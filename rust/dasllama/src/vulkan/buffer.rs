//! Device buffers, reached by shaders through their device address.

use super::device::{vk_err, Gpu};
use crate::{Error, Result};
use ash::vk;
use gpu_allocator::vulkan::{Allocation, AllocationCreateDesc, AllocationScheme};
use gpu_allocator::MemoryLocation;
use std::sync::Arc;

pub struct Buffer {
    gpu: Arc<Gpu>,
    pub raw: vk::Buffer,
    alloc: Option<Allocation>,
    pub size: u64,
    pub addr: u64,
}

impl Buffer {
    /// `size` bytes in `loc` (GpuOnly for weights, K/V and activations; CpuToGpu for the step's
    /// metadata; GpuToCpu for what comes back).
    pub fn new(gpu: &Arc<Gpu>, name: &str, size: u64, loc: MemoryLocation) -> Result<Buffer> {
        let size = size.max(16);
        let usage = vk::BufferUsageFlags::STORAGE_BUFFER
            | vk::BufferUsageFlags::SHADER_DEVICE_ADDRESS
            | vk::BufferUsageFlags::TRANSFER_SRC
            | vk::BufferUsageFlags::TRANSFER_DST;
        let info = vk::BufferCreateInfo::default().size(size).usage(usage);
        let d = &gpu.device;
        // SAFETY: valid create info; the buffer is destroyed in Drop after its memory is freed.
        let raw = unsafe { d.create_buffer(&info, None) }.map_err(vk_err("creating a device buffer"))?;
        // SAFETY: raw is a live buffer of this device.
        let requirements = unsafe { d.get_buffer_memory_requirements(raw) };
        let alloc = {
            let mut a = gpu.allocator.lock().unwrap_or_else(|e| e.into_inner());
            let a = a.as_mut().ok_or_else(|| Error::Device("the device is closing".into()))?;
            a.allocate(&AllocationCreateDesc { name, requirements, location: loc, linear: true, allocation_scheme: AllocationScheme::GpuAllocatorManaged })
        };
        let alloc = match alloc {
            Ok(a) => a,
            Err(e) => {
                // SAFETY: no memory is bound and nothing uses the buffer yet.
                unsafe { d.destroy_buffer(raw, None) };
                return Err(Error::Device(format!(
                    "allocating {size} bytes of device memory for {name}: {e}; serve fewer streams, a shorter context or a smaller model"
                )));
            }
        };
        // SAFETY: the allocation satisfies the buffer's requirements and outlives the binding.
        let bound = unsafe { d.bind_buffer_memory(raw, alloc.memory(), alloc.offset()) };
        let mut b = Buffer { gpu: gpu.clone(), raw, alloc: Some(alloc), size, addr: 0 };
        bound.map_err(vk_err("binding device memory"))?;
        // SAFETY: the buffer has the SHADER_DEVICE_ADDRESS usage and bound memory.
        b.addr = unsafe { d.get_buffer_device_address(&vk::BufferDeviceAddressInfo::default().buffer(raw)) };
        Ok(b)
    }

    /// The mapped bytes of a host-visible buffer.
    pub fn mapped(&mut self) -> &mut [u8] {
        let n = self.size as usize;
        &mut self.alloc.as_mut().and_then(|a| a.mapped_slice_mut()).expect("a host-visible buffer")[..n]
    }

    /// Write `src` at byte `off` of a host-visible buffer (the device reads little-endian f32s,
    /// which every host we build for holds them as already: one memcpy).
    pub fn put_f32s(&mut self, off: usize, src: &[f32]) {
        self.mapped()[off..off + 4 * src.len()].copy_from_slice(bytemuck::cast_slice(src));
    }

    /// Read `dst.len()` f32s from byte `off` of a host-visible buffer.
    pub fn get_f32s(&mut self, off: usize, dst: &mut [f32]) {
        let n = 4 * dst.len();
        bytemuck::cast_slice_mut(dst).copy_from_slice(&self.mapped()[off..off + n]);
    }

    /// Address of byte `off`.
    pub fn at(&self, off: u64) -> u64 {
        self.addr + off
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        // SAFETY: every submission that used this buffer has been waited for (see `Runner`: each
        // submit waits on its fence before returning), so the device no longer reads it.
        unsafe { self.gpu.device.destroy_buffer(self.raw, None) };
        if let Some(a) = self.alloc.take() {
            self.gpu.release(a);
        }
    }
}
