//! Element types of tensors and buffers, and the host types that map onto them.

use std::fmt;

/// The element type of a buffer. Sizes are in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DType {
    F32,
    F16,
    BF16,
    I32,
    U32,
    I64,
    U8,
}

impl DType {
    pub const fn size_in_bytes(self) -> usize {
        match self {
            DType::F32 | DType::I32 | DType::U32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::I64 => 8,
            DType::U8 => 1,
        }
    }

    /// The name used in kernel symbols (`{op}_{dtype}`) and in messages.
    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::I32 => "i32",
            DType::U32 => "u32",
            DType::I64 => "i64",
            DType::U8 => "u8",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A plain-old-data host type with a device counterpart.
pub trait HostType: bytemuck::Pod + Send + Sync + 'static {
    const DTYPE: DType;
}

macro_rules! host_type {
    ($($t:ty => $d:ident),* $(,)?) => {
        $(impl HostType for $t { const DTYPE: DType = DType::$d; })*
    };
}

host_type!(f32 => F32, half::f16 => F16, half::bf16 => BF16, i32 => I32, u32 => U32, i64 => I64, u8 => U8);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_types_match_their_dtype_sizes() {
        fn check<T: HostType>() {
            assert_eq!(std::mem::size_of::<T>(), T::DTYPE.size_in_bytes(), "{}", T::DTYPE);
        }
        check::<f32>();
        check::<half::f16>();
        check::<half::bf16>();
        check::<i32>();
        check::<u32>();
        check::<i64>();
        check::<u8>();
    }
}
