//! The architecture registry: `general.architecture` -> how to describe its layers.
//! A new family is one file with a `configure` function and one line here.

use super::config::Config;
use super::meta::Metadata;
use crate::Result;

pub struct ArchDesc {
    pub name: &'static str,
    pub configure: fn(&Metadata) -> Result<Config>,
}

static REGISTRY: &[ArchDesc] = &[
    ArchDesc { name: "llama", configure: super::llama::configure },
    ArchDesc { name: "mistral3", configure: super::mistral3::configure },
    ArchDesc { name: "gemma2", configure: super::gemma2::configure },
    ArchDesc { name: "gemma3", configure: super::gemma3::configure },
    ArchDesc { name: "gemma4", configure: super::gemma4::configure },
    ArchDesc { name: "glm4moe", configure: super::glm4moe::configure },
    ArchDesc { name: "gpt-oss", configure: super::gptoss::configure },
    ArchDesc { name: "phi3", configure: super::phi3::configure },
    ArchDesc { name: "qwen2", configure: super::qwen2::configure },
    ArchDesc { name: "qwen2vl", configure: super::qwen2vl::configure },
    ArchDesc { name: "qwen2moe", configure: super::qwen2moe::configure },
    ArchDesc { name: "qwen3", configure: super::qwen3::configure },
    ArchDesc { name: "qwen3vl", configure: super::qwen3vl::configure },
    ArchDesc { name: "qwen3moe", configure: super::qwen3moe::configure },
    ArchDesc { name: "qwen3vlmoe", configure: super::qwen3vlmoe::configure },
    ArchDesc { name: "qwen35", configure: super::qwen35::configure },
    ArchDesc { name: "qwen3next", configure: super::qwen3next::configure },
];

pub fn lookup(name: &str) -> Option<&'static ArchDesc> {
    REGISTRY.iter().find(|a| a.name == name)
}

pub fn arch_names() -> Vec<&'static str> {
    REGISTRY.iter().map(|a| a.name).collect()
}
