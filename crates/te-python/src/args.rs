//! Arguments from Python: configurations, access rights, devices, block-id lists and
//! request arrays, converted without touching elements one by one where the caller
//! hands over a buffer (numpy arrays) or a CPU int64 tensor.

use std::path::Path;
use std::time::Duration;

use pyo3::buffer::{Element, PyBuffer};
use pyo3::exceptions::{PyOverflowError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};
use te::config::Table;
use te::{Access, Config, ErrorKind, MemoryKind, Op, RegionId, TransferRequest};

use crate::errors::{te_err, IntoPy};

/// `None` → `$TE_CONFIG` or the defaults; a path → that file; a dict → the same
/// tables a file has (`{"engine": {"backend": "tcp"}, "backends": {...}}`).
pub(crate) fn config(obj: Option<&Bound<'_, PyAny>>) -> PyResult<Config> {
    let Some(obj) = obj.filter(|o| !o.is_none()) else {
        return Config::resolve(None).py_err();
    };
    if let Ok(dict) = obj.downcast::<PyDict>() {
        let table = table(dict)?;
        let text = table.to_string();
        return Config::from_toml(&text, "<dict>", Path::new(".")).py_err();
    }
    let path: std::path::PathBuf = obj.extract().map_err(|_| {
        PyTypeError::new_err("config must be None, a path to a TOML file, or a dict of tables")
    })?;
    Config::load(&path).py_err()
}

fn table(dict: &Bound<'_, PyDict>) -> PyResult<Table> {
    let mut t = Table::new();
    for (k, v) in dict.iter() {
        let key: String = k
            .extract()
            .map_err(|_| PyTypeError::new_err("config keys must be strings"))?;
        t.insert(key, value(&v)?);
    }
    Ok(t)
}

fn value(v: &Bound<'_, PyAny>) -> PyResult<toml::Value> {
    Ok(if v.is_instance_of::<PyBool>() {
        toml::Value::Boolean(v.extract()?)
    } else if v.is_instance_of::<PyInt>() {
        toml::Value::Integer(v.extract().map_err(|_| {
            PyOverflowError::new_err(format!(
                "config value {v} does not fit a TOML integer (64 bits, signed)"
            ))
        })?)
    } else if v.is_instance_of::<PyFloat>() {
        toml::Value::Float(v.extract()?)
    } else if v.is_instance_of::<PyString>() {
        toml::Value::String(v.extract()?)
    } else if let Ok(d) = v.downcast::<PyDict>() {
        toml::Value::Table(table(d)?)
    } else if v.is_instance_of::<PyList>() || v.is_instance_of::<PyTuple>() {
        toml::Value::Array(v.try_iter()?.map(|i| value(&i?)).collect::<PyResult<_>>()?)
    } else if let Ok(p) = v.extract::<std::path::PathBuf>() {
        toml::Value::String(p.display().to_string())
    } else {
        return Err(PyTypeError::new_err(format!(
            "config value {v} is not a str, int, float, bool, list or dict"
        )));
    })
}

/// `"rw"`, `"r"`, `"w"`, `"local"` or te's own names (`remote-read-write`, …).
pub(crate) fn access(s: &str) -> PyResult<Access> {
    let (remote_read, remote_write) = match s {
        "rw" | "remote-read-write" => (true, true),
        "r" | "ro" | "remote-read" => (true, false),
        "w" | "remote-write" => (false, true),
        "local" | "none" => (false, false),
        _ => {
            return Err(PyValueError::new_err(format!(
                "access `{s}` is not one of rw, r, w, local"
            )))
        }
    };
    Ok(Access {
        remote_read,
        remote_write,
    })
}

/// `host`/`cpu` → host memory; `cuda` → `cuda:0`; otherwise `RUNTIME:ORDINAL`.
pub(crate) fn device(s: &str) -> PyResult<MemoryKind> {
    match s {
        "host" | "cpu" => Ok(MemoryKind::Host),
        "cuda" | "mlu" => Ok(MemoryKind::Device {
            runtime: s.to_string(),
            ordinal: 0,
        }),
        _ => s.parse().py_err(),
    }
}

/// Seconds (int or float) → a duration; `None` stays `None`. More than a duration
/// holds (`float("inf")` included) is the longest one, which te's deadlines take as no
/// limit.
pub(crate) fn timeout(t: Option<f64>) -> PyResult<Option<Duration>> {
    t.map(|s| {
        if s.is_nan() || s < 0.0 {
            let what = if s.is_nan() {
                "not a number"
            } else {
                "negative"
            };
            return Err(PyValueError::new_err(format!(
                "timeout {s} is {what}; give seconds >= 0, or None for no limit"
            )));
        }
        Ok(Duration::try_from_secs_f64(s).unwrap_or(Duration::MAX))
    })
    .transpose()
}

fn from_buffer<T: Element + Copy>(
    obj: &Bound<'_, PyAny>,
) -> Option<PyResult<(Vec<T>, Vec<usize>)>> {
    let buf = PyBuffer::<T>::get(obj).ok()?;
    if !buf.is_c_contiguous() {
        return Some(Err(PyValueError::new_err(
            "the array is not C-contiguous; pass a contiguous copy",
        )));
    }
    Some(buf.to_vec(obj.py()).map(|v| (v, buf.shape().to_vec())))
}

fn non_negative<T: TryInto<u64> + Copy + std::fmt::Display>(
    v: Vec<T>,
    what: &str,
) -> PyResult<Vec<u64>> {
    v.into_iter()
        .map(|x| {
            x.try_into().map_err(|_| {
                PyValueError::new_err(format!(
                    "{what}: {x} is negative or does not fit 64 bits; give ints from 0 to 2**64 - 1"
                ))
            })
        })
        .collect()
}

/// An int from 0 to 2**64 - 1 (an address, a length): `TypeError` for what is no
/// int, `OverflowError` naming `what` for one out of that range.
pub(crate) fn uint(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<u64> {
    obj.extract::<u64>().map_err(|e| {
        if e.is_instance_of::<PyOverflowError>(obj.py()) {
            PyOverflowError::new_err(format!("{what} = {obj} is not an int from 0 to 2**64 - 1"))
        } else {
            PyTypeError::new_err(format!(
                "{what} must be an int, not {}",
                obj.get_type()
                    .name()
                    .map_or_else(|_| "?".into(), |n| n.to_string())
            ))
        }
    })
}

/// A flat array of non-negative integers and its shape: a buffer of int64, uint64,
/// int32 or uint32 (numpy), a contiguous int64 CPU tensor (by `data_ptr()`), or any
/// sequence of ints.
fn integers(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<(Vec<u64>, Vec<usize>)> {
    // A list of plain non-negative ints (Mooncake's callers pass lists) is read item by
    // item; anything else in it falls through to the checks below and their errors.
    if let Ok(list) = obj.downcast::<PyList>() {
        let v: Option<Vec<u64>> = list.iter().map(|x| x.extract::<u64>().ok()).collect();
        if let Some(v) = v {
            let n = v.len();
            return Ok((v, vec![n]));
        }
    }
    if let Some(r) = from_buffer::<i64>(obj) {
        let (v, s) = r?;
        return Ok((non_negative(v, what)?, s));
    }
    if let Some(r) = from_buffer::<u64>(obj) {
        return r;
    }
    if let Some(r) = from_buffer::<i32>(obj) {
        let (v, s) = r?;
        return Ok((non_negative(v, what)?, s));
    }
    if let Some(r) = from_buffer::<u32>(obj) {
        let (v, s) = r?;
        return Ok((v.into_iter().map(u64::from).collect(), s));
    }
    if obj.hasattr("data_ptr")? && obj.hasattr("dtype")? {
        return tensor_i64(obj, what);
    }
    if obj.is_instance_of::<PyString>() {
        return Err(PyTypeError::new_err(format!(
            "{what} must be a list, numpy array or int64 tensor of ints, not a str"
        )));
    }
    let v: Vec<i128> = obj.extract().map_err(|_| {
        PyTypeError::new_err(format!(
            "{what} must be a list, numpy array or int64 tensor of ints"
        ))
    })?;
    let n = v.len();
    Ok((non_negative(v, what)?, vec![n]))
}

fn tensor_i64(t: &Bound<'_, PyAny>, what: &str) -> PyResult<(Vec<u64>, Vec<usize>)> {
    let dtype = t.getattr("dtype")?.str()?.to_string();
    let device = t.getattr("device")?.str()?.to_string();
    if dtype != "torch.int64" || device != "cpu" {
        return Err(PyTypeError::new_err(format!(
            "{what}: a tensor of ids must be int64 on the CPU (got {dtype} on {device})"
        )));
    }
    if !t.call_method0("is_contiguous")?.extract::<bool>()? {
        return Err(PyValueError::new_err(format!(
            "{what}: the tensor is not contiguous; pass .contiguous()"
        )));
    }
    let n: usize = t.call_method0("numel")?.extract()?;
    let shape: Vec<usize> = t.getattr("shape")?.extract()?;
    let ptr: usize = t.call_method0("data_ptr")?.extract()?;
    if n == 0 {
        return Ok((Vec::new(), shape));
    }
    if ptr == 0 || ptr % std::mem::align_of::<i64>() != 0 {
        return Err(PyValueError::new_err(format!(
            "{what}: the tensor's data pointer is null or misaligned"
        )));
    }
    // SAFETY: a contiguous CPU tensor of `n` int64 elements starts at `ptr` (checked
    // non-null and aligned); `t` is borrowed and the GIL is held, so it stays alive and
    // no Python code runs while the elements are copied out.
    let v = unsafe { std::slice::from_raw_parts(ptr as *const i64, n) }.to_vec();
    Ok((non_negative(v, what)?, shape))
}

/// A list of block ids.
pub(crate) fn ids(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<u64>> {
    let (v, shape) = integers(obj, what)?;
    if shape.len() > 1 {
        return Err(PyValueError::new_err(format!(
            "{what} must be one-dimensional (got shape {shape:?})"
        )));
    }
    Ok(v)
}

/// Requests for [`te::Engine::transfer_with`]: rows of `(local_region, local_offset,
/// remote_region, remote_offset, length)`, as a list of tuples or an N×5 array.
pub(crate) fn requests(obj: &Bound<'_, PyAny>, op: Op) -> PyResult<Vec<TransferRequest>> {
    let (flat, shape) = if obj.is_instance_of::<PyList>() || obj.is_instance_of::<PyTuple>() {
        let mut flat = Vec::new();
        let mut n = 0;
        for row in obj.try_iter()? {
            let row: (u64, u64, u64, u64, u64) = row?.extract().map_err(|_| {
                PyTypeError::new_err(
                    "each request is (local_region, local_offset, remote_region, remote_offset, length), non-negative ints",
                )
            })?;
            flat.extend([row.0, row.1, row.2, row.3, row.4]);
            n += 1;
        }
        (flat, vec![n, 5])
    } else {
        integers(obj, "requests")?
    };
    if shape.len() != 2 || shape[1] != 5 {
        return Err(PyValueError::new_err(format!(
            "requests must be N×5 (local_region, local_offset, remote_region, remote_offset, length); got shape {shape:?}"
        )));
    }
    Ok(flat
        .chunks_exact(5)
        .map(|r| TransferRequest {
            op,
            local: RegionId(r[0]),
            local_offset: r[1],
            remote: RegionId(r[2]),
            remote_offset: r[3],
            len: r[4],
        })
        .collect())
}

/// `"write"` or `"read"`.
pub(crate) fn op(s: &str) -> PyResult<Op> {
    s.parse::<Op>().map_err(|_| {
        te_err(
            ErrorKind::InvalidRequest,
            "transfer",
            format!("op `{s}` is not `write` or `read`"),
        )
    })
}
