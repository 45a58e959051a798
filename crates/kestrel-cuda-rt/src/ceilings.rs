//! What a device can do at best, the denominators of every floor Kestrel reports: the
//! device-to-device copy bandwidth (bytes read plus bytes written per second) and the bf16
//! tensor-core GEMM rate. Devices measured by this project come from the table here, keyed by
//! name; any other device is measured once, on first use (`Device::ceilings`), and the result
//! kept with the device.

/// A device's ceilings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Ceilings {
    /// Device-to-device copy: bytes read plus bytes written, per second.
    pub copy_bytes_per_s: f64,
    /// A large bf16 GEMM through cuBLAS: 2·m·n·k per second.
    pub bf16_flops_per_s: f64,
    /// Where the figures come from: `table` (measured by this project on that device) or
    /// `measured` (on this device, by this process).
    pub source: &'static str,
}

/// The H200's, measured here: `kestrel bench runtime` (a 1 GiB copy, 4,240-4,250 GB/s) and
/// cuBLAS bf16 GEMMs of 4096-8192 a side (about 790 TFLOP/s). Also the figure commands that
/// have no device use (`kestrel inspect`).
pub const H200: Ceilings = Ceilings {
    copy_bytes_per_s: 4.26e12,
    bf16_flops_per_s: 790e12,
    source: "table",
};

/// Devices whose ceilings were measured here, by a name the driver's device name contains.
const TABLE: &[(&str, Ceilings)] = &[("H200", H200)];

/// The ceilings of a device called `name`, if the table has it.
pub fn known(name: &str) -> Option<Ceilings> {
    TABLE.iter().find(|(key, _)| name.contains(key)).map(|&(_, c)| c)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_is_keyed_by_the_driver_name() {
        let c = known("NVIDIA H200").unwrap();
        assert_eq!((c.copy_bytes_per_s, c.bf16_flops_per_s), (4.26e12, 790e12));
        assert_eq!(c.source, "table");
        assert!(known("NVIDIA GeForce RTX 4090").is_none());
    }
}
