//! te's list-copy kernel (`copy_list.ptx`): loaded per device with `cuModuleLoadData`,
//! launched once per group over a table of (source, destination, length) entries that
//! lies in pinned host memory mapped for the device, so a launch needs no upload of its
//! own. A table stays the group's until its event has completed, then goes back to the
//! device's pool.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::sys;

use crate::error::{Error, ErrorKind, Result};
use crate::sync::Mutex;

use super::{driver, Handle, Range};

/// The kernel's PTX, NUL-terminated as `cuModuleLoadData` reads it.
pub(super) const PTX: &str = concat!(include_str!("copy_list.ptx"), "\0");

/// The entry point's name.
const ENTRY: &[u8] = b"te_copy_list\0";

/// Bytes of one table entry: source, destination and length, 8 bytes each.
const ENTRY_BYTES: usize = 24;

/// Threads per block; each moves 16 bytes per step.
const THREADS: u32 = 256;

/// The most blocks working on one entry.
const MAX_BLOCKS_PER_ENTRY: u64 = 512;

/// A grid's largest y dimension: entries beyond it are looped over by the kernel.
const MAX_GRID_Y: usize = 65_535;

/// A kernel table: pinned host memory the device reads through its mapping.
#[derive(Debug)]
pub(super) struct Table {
    host: usize,
    dev: u64,
    /// Entries it holds.
    cap: usize,
}

/// The kernel loaded on one device, and its pool of tables.
#[derive(Debug)]
pub(super) struct Kernel {
    func: Handle<sys::CUfunction>,
    tables: Arc<Mutex<Vec<Table>>>,
}

/// The grid for `ranges`: blocks per entry (enough for the longest to take four steps
/// of every thread, at most [`MAX_BLOCKS_PER_ENTRY`]) and entries at once.
pub(super) fn grid(ranges: &[Range]) -> (u32, u32) {
    let longest = ranges.iter().map(|r| r.len as u64).max().unwrap_or(0);
    let per_block = u64::from(THREADS) * 16 * 4;
    let x = longest.div_ceil(per_block).clamp(1, MAX_BLOCKS_PER_ENTRY);
    let y = ranges.len().clamp(1, MAX_GRID_Y);
    (x as u32, y as u32)
}

/// The bytes of `ranges` as the kernel reads its table.
pub(super) fn encode(ranges: &[Range], out: &mut [u8]) {
    for (r, e) in ranges.iter().zip(out.chunks_exact_mut(ENTRY_BYTES)) {
        e[..8].copy_from_slice(&r.src.to_le_bytes());
        e[8..16].copy_from_slice(&r.dst.to_le_bytes());
        e[16..].copy_from_slice(&(r.len as u64).to_le_bytes());
    }
}

impl Kernel {
    /// Loads the kernel on the current context's device.
    ///
    /// # Errors
    /// The driver's error (a JIT failure names the PTX's problem).
    pub(super) fn load(ordinal: u32) -> Result<Kernel> {
        let mut module: sys::CUmodule = std::ptr::null_mut();
        // SAFETY: a context is current; `PTX` is a NUL-terminated PTX image.
        driver("load te's list-copy kernel", || unsafe {
            sys::cuModuleLoadData(&mut module, PTX.as_ptr().cast()).result()
        })?;
        let mut func: sys::CUfunction = std::ptr::null_mut();
        // SAFETY: `module` was loaded above; `ENTRY` is NUL-terminated. The module is
        // kept for the process's life (devices are never torn down).
        driver("find te_copy_list", || unsafe {
            sys::cuModuleGetFunction(&mut func, module, ENTRY.as_ptr().cast()).result()
        })
        .map_err(|e| e.with_context("cuda", ordinal))?;
        Ok(Kernel {
            func: Handle(func),
            tables: Arc::new(Mutex::new(Vec::new())),
        })
    }

    /// The pool tables go back to.
    pub(super) fn tables(&self) -> Arc<Mutex<Vec<Table>>> {
        self.tables.clone()
    }

    /// Gives a table back once the group that used it has completed.
    pub(super) fn give_back(&self, t: Table) {
        self.tables.lock().push(t);
    }

    /// A table of at least `n` entries, from the pool or new (a context current).
    fn table(&self, n: usize) -> Result<Table> {
        {
            let mut pool = self.tables.lock();
            if let Some(i) = pool.iter().position(|t| t.cap >= n) {
                return Ok(pool.swap_remove(i));
            }
        }
        let cap = n.next_power_of_two().max(256);
        let mut host: *mut c_void = std::ptr::null_mut();
        // SAFETY: a context is current; `host` is a valid out-parameter. 1 | 2 =
        // CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP: pinned for every
        // context and mapped into the device's address space.
        driver("allocate a kernel table", || unsafe {
            sys::cuMemHostAlloc(&mut host, cap * ENTRY_BYTES, 1 | 2).result()
        })?;
        let mut dev: sys::CUdeviceptr = 0;
        // SAFETY: `host` is mapped pinned memory from above; `dev` an out-parameter.
        let mapped = driver("map a kernel table", || unsafe {
            sys::cuMemHostGetDevicePointer_v2(&mut dev, host, 0).result()
        });
        if let Err(e) = mapped {
            // SAFETY: `host` came from cuMemHostAlloc above and is used by nothing.
            let _ = unsafe { sys::cuMemFreeHost(host) };
            return Err(e);
        }
        Ok(Table {
            host: host as usize,
            dev,
            cap,
        })
    }

    /// Launches the kernel over `ranges` on `stream` (its device's context current):
    /// the table it reads, to keep until the stream has passed the launch; or the error,
    /// with the table if one was taken (nothing was enqueued then).
    ///
    /// # Safety
    /// Every range lies in device memory of this context's device (or memory it maps),
    /// valid until the stream has passed the launch; the ranges do not overlap.
    pub(super) unsafe fn launch(
        &self,
        ranges: &[Range],
        stream: sys::CUstream,
    ) -> std::result::Result<Table, (Option<Table>, Error)> {
        let n = ranges.len();
        let mut count = u32::try_from(n).map_err(|_| {
            let e = Error::new(
                ErrorKind::InvalidRequest,
                "more than 2^32 copies in one group",
            );
            (None, e)
        })?;
        let table = self.table(n).map_err(|e| (None, e))?;
        // SAFETY: the table holds `cap >= n` entries of pinned memory, and no launch
        // reads it: it was in the pool, given back only after its last group ended.
        let bytes =
            unsafe { std::slice::from_raw_parts_mut(table.host as *mut u8, n * ENTRY_BYTES) };
        encode(ranges, bytes);
        let (x, y) = grid(ranges);
        let mut dev = table.dev;
        let mut params = [
            (&mut dev as *mut u64).cast::<c_void>(),
            (&mut count as *mut u32).cast::<c_void>(),
        ];
        // SAFETY: `func` is this device's kernel, whose parameters are a u64 and a u32,
        // pointed to by `params` through the call (the driver copies them); the table
        // stays valid until the caller's event has completed.
        let r = driver("launch te's list-copy kernel", || unsafe {
            sys::cuLaunchKernel(
                self.func.0,
                x,
                y,
                1,
                THREADS,
                1,
                1,
                0,
                stream,
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
            .result()
        });
        match r {
            Ok(()) => Ok(table),
            Err(e) => Err((Some(table), e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_table_entry_is_source_destination_and_length_little_endian() {
        let ranges = [
            Range {
                src: 0x1122,
                dst: 0x3344,
                len: 5,
            },
            Range {
                src: 1,
                dst: 2,
                len: 1 << 40,
            },
        ];
        let mut out = vec![0u8; 2 * ENTRY_BYTES];
        encode(&ranges, &mut out);
        assert_eq!(&out[..8], &0x1122u64.to_le_bytes());
        assert_eq!(&out[8..16], &0x3344u64.to_le_bytes());
        assert_eq!(&out[16..24], &5u64.to_le_bytes());
        assert_eq!(&out[40..48], &(1u64 << 40).to_le_bytes());
    }

    #[test]
    fn the_grid_spreads_long_entries_and_caps_both_dimensions() {
        let r = |len| Range {
            src: 0,
            dst: 0,
            len,
        };
        assert_eq!(grid(&[r(4096); 128]), (1, 128));
        assert_eq!(grid(&[r(32 << 10); 128]), (2, 128));
        assert_eq!(grid(&[r(1 << 20); 64]), (64, 64));
        assert_eq!(grid(&[r(1 << 30)]), (512, 1));
        assert_eq!(grid(&vec![r(16); 100_000]), (1, 65_535));
    }

    #[test]
    fn the_ptx_declares_the_entry_with_its_two_parameters() {
        assert!(PTX.ends_with('\0') && !PTX[..PTX.len() - 1].contains('\0'));
        assert!(PTX.contains(".visible .entry te_copy_list("));
        assert!(PTX.contains(".param .u64 te_copy_list_table"));
        assert!(PTX.contains(".param .u32 te_copy_list_count"));
        assert!(PTX.contains(".address_size 64"));
    }

    /// Assembles the PTX for three GPU generations with `ptxas` (from the CUDA toolkit,
    /// or the `nvidia-cuda-nvcc-cu12` wheel), found as `$TE_PTXAS` or on the `PATH`;
    /// skipped, saying so, where there is none.
    #[test]
    fn ptxas_accepts_the_kernel_for_maxwell_ampere_and_hopper() {
        let ptxas = std::env::var("TE_PTXAS").unwrap_or_else(|_| "ptxas".into());
        let dir = std::env::temp_dir().join(format!("te-ptx-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let src = dir.join("copy_list.ptx");
        std::fs::write(&src, &PTX[..PTX.len() - 1]).unwrap();
        for arch in ["sm_52", "sm_80", "sm_90"] {
            let out = std::process::Command::new(&ptxas)
                .arg("--gpu-name")
                .arg(arch)
                .arg(&src)
                .arg("-o")
                .arg(dir.join(format!("{arch}.cubin")))
                .output();
            let out = match out {
                Ok(o) => o,
                Err(e) => {
                    eprintln!("skipped: no ptxas ({ptxas}: {e}); set TE_PTXAS to check the kernel");
                    let _ = std::fs::remove_dir_all(&dir);
                    return;
                }
            };
            let err = String::from_utf8_lossy(&out.stderr);
            let unknown =
                err.contains("Unsupported gpu architecture") || err.contains("is not defined");
            if !out.status.success() && unknown {
                // CUDA 13's ptxas no longer assembles for Maxwell; drivers still JIT it.
                eprintln!("skipped {arch}: this ptxas does not know it ({err})");
                continue;
            }
            assert!(out.status.success(), "ptxas --gpu-name {arch}: {err}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
