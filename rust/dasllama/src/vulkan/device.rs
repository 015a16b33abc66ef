//! One Vulkan device: the loader (libvulkan, opened at run time so the crate runs where there is
//! none), the instance, the chosen physical device and its compute queue, and the allocator.
//!
//! Choice: `DASLLAMA_VK_DEVICE=<index|name substring>` picks one; otherwise a discrete GPU before
//! an integrated or virtual one. CPU-type devices (Mesa's lavapipe) only with
//! `DASLLAMA_VK_ALLOW_CPU=1`: they run every kernel, slower than our own CPU path.

use crate::{Error, Result};
use ash::vk;
use gpu_allocator::vulkan::{Allocator, AllocatorCreateDesc};
use std::ffi::CStr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

pub(crate) fn vk_err(what: &str) -> impl Fn(vk::Result) -> Error + '_ {
    move |e| match e {
        vk::Result::ERROR_DEVICE_LOST => {
            Error::DeviceLost(format!("{what}: the Vulkan device was lost (driver reset or GPU fault); the stream ends here and new ones run on the CPU"))
        }
        vk::Result::ERROR_OUT_OF_DEVICE_MEMORY | vk::Result::ERROR_OUT_OF_HOST_MEMORY => {
            Error::Device(format!("{what}: out of device memory ({e}); serve fewer streams or a shorter context (--gpu-regions, --ctx)"))
        }
        e => Error::Device(format!("{what}: Vulkan error {e}")),
    }
}

/// What enumeration found: every device, and which one we would take (or why none).
#[derive(Clone, Debug)]
pub struct DeviceInfo {
    pub index: usize,
    pub name: String,
    /// "discrete", "integrated", "virtual", "cpu" or "other".
    pub kind: &'static str,
    pub api_version: String,
    /// Sum of the device-local heaps.
    pub vram_bytes: u64,
}

pub struct Gpu {
    pub info: DeviceInfo,
    /// Keeps libvulkan loaded for as long as the device lives.
    _entry: ash::Entry,
    pub instance: ash::Instance,
    pub physical: vk::PhysicalDevice,
    pub device: ash::Device,
    pub queue: vk::Queue,
    /// Submissions to the queue from models that step at once (Vulkan wants them one at a
    /// time); held for the submit call only, not while the step runs.
    pub queue_lock: Mutex<()>,
    pub queue_family: u32,
    pub allocator: Mutex<Option<Allocator>>,
    pub memory_budget: bool,
    /// Set once a call saw the device lost: nothing on it answers again.
    pub lost: AtomicBool,
    /// Test hook: the next submission reports a lost device.
    #[cfg(feature = "fault-injection")]
    pub fault: AtomicBool,
}

impl Gpu {
    pub fn is_lost(&self) -> bool {
        self.lost.load(Ordering::SeqCst)
    }

    /// Record what a failed call says: a lost device stays lost.
    pub fn note(&self, e: &Error) {
        if matches!(e, Error::DeviceLost(_)) {
            self.lost.store(true, Ordering::SeqCst);
        }
    }
}

fn kind_name(t: vk::PhysicalDeviceType) -> &'static str {
    match t {
        vk::PhysicalDeviceType::DISCRETE_GPU => "discrete",
        vk::PhysicalDeviceType::INTEGRATED_GPU => "integrated",
        vk::PhysicalDeviceType::VIRTUAL_GPU => "virtual",
        vk::PhysicalDeviceType::CPU => "cpu",
        _ => "other",
    }
}

fn load_entry() -> Result<ash::Entry> {
    // SAFETY: loading libvulkan runs its initialisers; the loader is a well-behaved system library
    // and we keep the Entry alive for as long as anything made from it.
    unsafe { ash::Entry::load() }.map_err(|e| {
        Error::Device(format!("no Vulkan loader on this machine ({e}); install libvulkan1 and a driver (mesa-vulkan-drivers), or serve on the CPU"))
    })
}

fn create_instance(entry: &ash::Entry) -> Result<ash::Instance> {
    let app = vk::ApplicationInfo::default().application_name(c"dasllama").api_version(vk::API_VERSION_1_2);
    let ci = vk::InstanceCreateInfo::default().application_info(&app);
    // SAFETY: valid create info; the instance is destroyed in Gpu::drop (or below on failure).
    unsafe { entry.create_instance(&ci, None) }.map_err(|e| match e {
        vk::Result::ERROR_INCOMPATIBLE_DRIVER => {
            Error::Device("the Vulkan loader found no driver (install mesa-vulkan-drivers or your GPU vendor's Vulkan driver)".into())
        }
        e => vk_err("creating a Vulkan instance")(e),
    })
}

fn describe(instance: &ash::Instance, i: usize, pd: vk::PhysicalDevice) -> DeviceInfo {
    // SAFETY: pd comes from this instance's enumeration.
    let (props, mem) = unsafe { (instance.get_physical_device_properties(pd), instance.get_physical_device_memory_properties(pd)) };
    let name = props.device_name_as_c_str().map(|c| c.to_string_lossy().into_owned()).unwrap_or_default();
    let vram_bytes =
        mem.memory_heaps[..mem.memory_heap_count as usize].iter().filter(|h| h.flags.contains(vk::MemoryHeapFlags::DEVICE_LOCAL)).map(|h| h.size).sum();
    let v = props.api_version;
    DeviceInfo {
        index: i,
        name,
        kind: kind_name(props.device_type),
        api_version: format!("{}.{}.{}", vk::api_version_major(v), vk::api_version_minor(v), vk::api_version_patch(v)),
        vram_bytes,
    }
}

/// Every Vulkan device on this machine (empty where there is no loader or no driver).
pub fn enumerate() -> Result<Vec<DeviceInfo>> {
    let entry = load_entry()?;
    let instance = create_instance(&entry)?;
    // SAFETY: the instance is valid and destroyed right after.
    let out = unsafe { instance.enumerate_physical_devices() }.map(|pds| pds.into_iter().enumerate().map(|(i, pd)| describe(&instance, i, pd)).collect());
    // SAFETY: nothing made from the instance outlives this call.
    unsafe { instance.destroy_instance(None) };
    out.map_err(vk_err("enumerating Vulkan devices"))
}

/// Which device to take: the one `pick` names (an index or part of a name; the Python side
/// passes `DASLLAMA_VK_DEVICE` where the caller names none), else the best kind; a CPU-type
/// device only where `allow_cpu` (`DASLLAMA_VK_ALLOW_CPU=1`); a plain-words reason when none
/// qualifies.
pub fn choose(devices: &[DeviceInfo], pick: Option<&str>, allow_cpu: bool) -> std::result::Result<usize, String> {
    if devices.is_empty() {
        return Err("the Vulkan loader found no device (no driver installed?)".into());
    }
    let usable = |d: &DeviceInfo| d.kind != "cpu" || allow_cpu;
    if let Some(want) = pick {
        let hit = want
            .parse::<usize>()
            .ok()
            .filter(|&i| i < devices.len())
            .or_else(|| devices.iter().position(|d| d.name.to_lowercase().contains(&want.to_lowercase())));
        return match hit {
            Some(i) if usable(&devices[i]) => Ok(i),
            Some(i) => Err(format!("'{want}' picks '{}', a CPU-type Vulkan device; set DASLLAMA_VK_ALLOW_CPU=1 to use it anyway", devices[i].name)),
            None => Err(format!(
                "the Vulkan device '{want}' names no device; there are: {}",
                devices.iter().map(|d| format!("{} '{}'", d.index, d.name)).collect::<Vec<_>>().join(", ")
            )),
        };
    }
    let rank = |d: &DeviceInfo| match d.kind {
        "discrete" => 0,
        "integrated" => 1,
        "virtual" => 2,
        "other" => 3,
        _ => 4,
    };
    devices.iter().filter(|d| usable(d)).min_by_key(|d| (rank(d), d.index)).map(|d| d.index).ok_or_else(|| {
        format!(
            "the only Vulkan devices here run on the CPU ({}); set DASLLAMA_VK_ALLOW_CPU=1 to use one anyway (slower than the CPU path)",
            devices.iter().map(|d| d.name.as_str()).collect::<Vec<_>>().join(", ")
        )
    })
}

impl Gpu {
    /// Open the device `choose` picks.
    pub fn open(pick: Option<&str>, allow_cpu: bool) -> Result<Gpu> {
        let entry = load_entry()?;
        let instance = create_instance(&entry)?;
        let built = Self::open_on(&instance, pick, allow_cpu);
        match built {
            Ok((info, physical, device, queue_family, memory_budget)) => {
                // SAFETY: the device was created with one queue in this family.
                let queue = unsafe { device.get_device_queue(queue_family, 0) };
                let allocator = Allocator::new(&AllocatorCreateDesc {
                    instance: instance.clone(),
                    device: device.clone(),
                    physical_device: physical,
                    debug_settings: Default::default(),
                    buffer_device_address: true,
                    allocation_sizes: Default::default(),
                })
                .map_err(|e| Error::Device(format!("creating the device memory allocator: {e}")))?;
                Ok(Gpu {
                    info,
                    _entry: entry,
                    instance,
                    physical,
                    device,
                    queue,
                    queue_lock: Mutex::new(()),
                    queue_family,
                    allocator: Mutex::new(Some(allocator)),
                    memory_budget,
                    lost: AtomicBool::new(false),
                    #[cfg(feature = "fault-injection")]
                    fault: AtomicBool::new(false),
                })
            }
            Err(e) => {
                // SAFETY: nothing else was made from this instance.
                unsafe { instance.destroy_instance(None) };
                Err(e)
            }
        }
    }

    fn open_on(instance: &ash::Instance, pick: Option<&str>, allow_cpu: bool) -> Result<(DeviceInfo, vk::PhysicalDevice, ash::Device, u32, bool)> {
        // SAFETY: valid instance.
        let pds = unsafe { instance.enumerate_physical_devices() }.map_err(vk_err("enumerating Vulkan devices"))?;
        let infos: Vec<DeviceInfo> = pds.iter().enumerate().map(|(i, &pd)| describe(instance, i, pd)).collect();
        let pick = choose(&infos, pick, allow_cpu).map_err(Error::Device)?;
        let pd = pds[pick];
        // SAFETY: pd is a device of this instance.
        let props = unsafe { instance.get_physical_device_properties(pd) };
        if props.api_version < vk::API_VERSION_1_2 {
            return Err(Error::Device(format!(
                "'{}' offers Vulkan {}; dasllama needs 1.2 (buffer device addresses)",
                infos[pick].name, infos[pick].api_version
            )));
        }
        // SAFETY: as above.
        let families = unsafe { instance.get_physical_device_queue_family_properties(pd) };
        let qf = families
            .iter()
            .position(|f| f.queue_flags.contains(vk::QueueFlags::COMPUTE))
            .ok_or_else(|| Error::Device(format!("'{}' has no compute queue", infos[pick].name)))? as u32;
        let mut f12 = vk::PhysicalDeviceVulkan12Features::default();
        let mut feats = vk::PhysicalDeviceFeatures2::default().push_next(&mut f12);
        // SAFETY: as above; the chain outlives the call.
        unsafe { instance.get_physical_device_features2(pd, &mut feats) };
        if f12.buffer_device_address == vk::FALSE {
            return Err(Error::Device(format!("'{}' lacks bufferDeviceAddress, which every kernel here uses", infos[pick].name)));
        }
        // SAFETY: as above.
        let exts = unsafe { instance.enumerate_device_extension_properties(pd) }.map_err(vk_err("listing device extensions"))?;
        let has = |name: &CStr| exts.iter().any(|e| e.extension_name_as_c_str().is_ok_and(|n| n == name));
        let budget = has(ash::ext::memory_budget::NAME);
        let mut ext_names = Vec::new();
        if budget {
            ext_names.push(ash::ext::memory_budget::NAME.as_ptr());
        }
        let prio = [1.0f32];
        let qci = [vk::DeviceQueueCreateInfo::default().queue_family_index(qf).queue_priorities(&prio)];
        let mut want12 = vk::PhysicalDeviceVulkan12Features::default().buffer_device_address(true);
        let dci = vk::DeviceCreateInfo::default().queue_create_infos(&qci).enabled_extension_names(&ext_names).push_next(&mut want12);
        // SAFETY: valid create info naming only features and extensions the device reports.
        let device = unsafe { instance.create_device(pd, &dci, None) }.map_err(vk_err("creating the Vulkan device"))?;
        Ok((infos[pick].clone(), pd, device, qf, budget))
    }

    /// (budget, usage) of device-local memory in bytes: VK_EXT_memory_budget where present,
    /// else the heap sizes and what our allocator holds.
    pub fn memory(&self) -> (u64, u64) {
        // SAFETY: valid physical device; the chained struct outlives the call.
        unsafe {
            let mut b = vk::PhysicalDeviceMemoryBudgetPropertiesEXT::default();
            let mut p = vk::PhysicalDeviceMemoryProperties2::default();
            if self.memory_budget {
                p = p.push_next(&mut b);
            }
            self.instance.get_physical_device_memory_properties2(self.physical, &mut p);
            let mp = p.memory_properties;
            let local = |i: usize| mp.memory_heaps[i].flags.contains(vk::MemoryHeapFlags::DEVICE_LOCAL);
            let heaps = 0..mp.memory_heap_count as usize;
            if self.memory_budget {
                let budget = heaps.clone().filter(|&i| local(i)).map(|i| b.heap_budget[i]).sum();
                let used = heaps.filter(|&i| local(i)).map(|i| b.heap_usage[i]).sum();
                (budget, used)
            } else {
                let size = heaps.filter(|&i| local(i)).map(|i| mp.memory_heaps[i].size).sum();
                (size, self.allocated())
            }
        }
    }

    /// Bytes our allocator holds in device memory blocks.
    /// Free `a`. The allocator keeps its last empty block of each memory type for the next
    /// allocation; once nothing is allocated at all, it starts afresh, so dropping the last model
    /// on a device gives back every byte it took.
    pub fn release(&self, a: gpu_allocator::vulkan::Allocation) {
        let mut al = self.allocator.lock().unwrap_or_else(|e| e.into_inner());
        let Some(inner) = al.as_mut() else { return };
        let _ = inner.free(a);
        if inner.generate_report().total_allocated_bytes == 0 {
            let desc = AllocatorCreateDesc {
                instance: self.instance.clone(),
                device: self.device.clone(),
                physical_device: self.physical,
                debug_settings: Default::default(),
                buffer_device_address: true,
                allocation_sizes: Default::default(),
            };
            // A fresh allocator holds no block; should making one fail, the old one stays.
            if let Ok(fresh) = Allocator::new(&desc) {
                *al = Some(fresh);
            }
        }
    }

    pub fn allocated(&self) -> u64 {
        let a = self.allocator.lock().unwrap_or_else(|e| e.into_inner());
        a.as_ref().map_or(0, |a| a.generate_report().total_reserved_bytes)
    }
}

impl Drop for Gpu {
    fn drop(&mut self) {
        // The allocator frees its blocks through the device, so it goes first.
        drop(self.allocator.lock().unwrap_or_else(|e| e.into_inner()).take());
        // SAFETY: every buffer, pipeline and command pool made from this device is owned by
        // something that holds an Arc<Gpu>, so none is left when the last Arc drops.
        unsafe {
            let _ = self.device.device_wait_idle();
            self.device.destroy_device(None);
            self.instance.destroy_instance(None);
        }
    }
}
