//! Stage fences: order work across streams with monotonically increasing values.
//!
//! `signal(stream)` records an event on `stream` and returns the next value N; `wait(stream, N)`
//! makes `stream` wait on the device, without blocking the host, for everything submitted to
//! the signalling stream before N. Waiting for a value already known complete costs nothing;
//! waiting for a value never signalled is an error (CUDA events cannot wait for the future).

use std::collections::BTreeMap;
use std::sync::Arc;

use cudarc::driver::CudaEvent;

use crate::counters::Counters;
use crate::device::Device;
use crate::error::{CudaError, Result};
use crate::stream::Stream;

pub struct StageFence {
    label: String,
    counters: Arc<Counters>,
    /// Last value signalled; values start at 1.
    value: u64,
    /// Every value at or below this one is known complete, so waits for it are no-ops.
    completed: u64,
    /// Events of signalled values not yet known complete.
    events: BTreeMap<u64, CudaEvent>,
    signals: u64,
    waits: u64,
}

impl StageFence {
    pub fn new(device: &Device, label: impl Into<String>) -> Self {
        StageFence {
            label: label.into(),
            counters: device.counters_ref().clone(),
            value: 0,
            completed: 0,
            events: BTreeMap::new(),
            signals: 0,
            waits: 0,
        }
    }

    pub fn label(&self) -> &str {
        &self.label
    }

    /// Signals the next value after everything submitted to `stream` so far; returns it.
    pub fn signal(&mut self, stream: &Stream) -> Result<u64> {
        self.forget_completed()?;
        let event = stream.record_event(None)?;
        self.value += 1;
        self.events.insert(self.value, event);
        self.signals += 1;
        self.counters.add_fence_signals(1);
        Ok(self.value)
    }

    /// Makes `stream` wait until `value` has been reached.
    pub fn wait(&mut self, stream: &Stream, value: u64) -> Result<()> {
        if value > self.value {
            return Err(CudaError::FenceNotSignalled {
                value,
                last: self.value,
            });
        }
        self.waits += 1;
        self.counters.add_fence_waits(1);
        if value <= self.completed {
            return Ok(());
        }
        // Events are recorded in value order on one or more streams; waiting for the event of
        // `value` covers it, and the events of smaller values still pending on other streams
        // are waited for too, so "value N reached" implies every value below it.
        for (_, event) in self.events.range(..=value) {
            stream.wait_event(event)?;
        }
        Ok(())
    }

    /// Blocks the host until `value` has been reached.
    pub fn host_wait(&mut self, value: u64) -> Result<()> {
        if value > self.value {
            return Err(CudaError::FenceNotSignalled {
                value,
                last: self.value,
            });
        }
        self.counters.add_host_syncs(1);
        for (_, event) in self.events.range(..=value) {
            event
                .synchronize()
                .map_err(CudaError::driver("cuEventSynchronize"))?;
        }
        self.completed = self.completed.max(value);
        self.events = self.events.split_off(&(value + 1));
        Ok(())
    }

    /// The last value signalled (0 before the first signal).
    pub fn value(&self) -> u64 {
        self.value
    }

    /// The highest value known complete.
    pub fn completed(&self) -> u64 {
        self.completed
    }

    pub fn signal_count(&self) -> u64 {
        self.signals
    }

    pub fn wait_count(&self) -> u64 {
        self.waits
    }

    /// Drops events of a completed prefix of values.
    fn forget_completed(&mut self) -> Result<()> {
        while let Some((&v, e)) = self.events.first_key_value() {
            if e.try_is_complete().map_err(CudaError::driver("cuEventQuery"))? {
                self.events.remove(&v);
                self.completed = v;
            } else {
                break;
            }
        }
        Ok(())
    }
}
