//! What torch's state dicts name: the allow-listed globals and the
//! tensor-rebuild functions and persistent storage ids, interpreted.

use std::rc::Rc;

use candle_core::DType;

use super::value::*;
use super::*;

/// The globals a state dict may name. Only the functions are ever applied
/// (by [`Machine::reduce`], which interprets them); the classes are markers.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum Global {
    OrderedDict,
    RebuildTensorV2,
    RebuildTensor,
    RebuildParameter,
    RebuildParameterWithState,
    RebuildFromTypeV2,
    TensorClass,
    ParameterClass,
    Storage(DType),
}

impl Global {
    pub(super) fn resolve(module: &str, name: &str) -> Result<Self, String> {
        let storage = |d| Ok(Global::Storage(d));
        match (module, name) {
            ("collections", "OrderedDict") => Ok(Global::OrderedDict),
            ("torch._utils", "_rebuild_tensor_v2") => Ok(Global::RebuildTensorV2),
            ("torch._utils", "_rebuild_tensor") => Ok(Global::RebuildTensor),
            ("torch._utils", "_rebuild_parameter") => Ok(Global::RebuildParameter),
            ("torch._utils", "_rebuild_parameter_with_state") => {
                Ok(Global::RebuildParameterWithState)
            }
            ("torch._tensor", "_rebuild_from_type_v2") => Ok(Global::RebuildFromTypeV2),
            ("torch", "Tensor") => Ok(Global::TensorClass),
            ("torch.nn.parameter", "Parameter") => Ok(Global::ParameterClass),
            ("torch", "HalfStorage") => storage(DType::F16),
            ("torch", "FloatStorage") => storage(DType::F32),
            ("torch", "BFloat16Storage") => storage(DType::BF16),
            ("torch", "DoubleStorage") => storage(DType::F64),
            ("torch", "LongStorage") => storage(DType::I64),
            ("torch", "IntStorage") => storage(DType::I32),
            ("torch", "ShortStorage") => storage(DType::I16),
            ("torch", "ByteStorage" | "BoolStorage") => storage(DType::U8),
            _ => Err(format!(
                "global `{module}.{name}` is not allowed: a checkpoint may only name the dict types, \
                 storage types and tensor-rebuild functions of a torch state dict (nothing in it is run)"
            )),
        }
    }

    pub(super) fn name(self) -> String {
        match self {
            Global::OrderedDict => "collections.OrderedDict".into(),
            Global::RebuildTensorV2 => "torch._utils._rebuild_tensor_v2".into(),
            Global::RebuildTensor => "torch._utils._rebuild_tensor".into(),
            Global::RebuildParameter => "torch._utils._rebuild_parameter".into(),
            Global::RebuildParameterWithState => {
                "torch._utils._rebuild_parameter_with_state".into()
            }
            Global::RebuildFromTypeV2 => "torch._tensor._rebuild_from_type_v2".into(),
            Global::TensorClass => "torch.Tensor".into(),
            Global::ParameterClass => "torch.nn.parameter.Parameter".into(),
            Global::Storage(d) => format!("torch storage of {d:?}"),
        }
    }
}

/// `_rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad,
/// backward_hooks[, metadata])` or `_rebuild_tensor(storage, offset, size, stride)`.
pub(super) fn rebuild_tensor(g: Global, a: &[Value]) -> Result<Value, String> {
    let f = g.name();
    let storage = match a.first() {
        Some(Value::Storage(s)) => s.clone(),
        other => {
            return Err(format!(
                "`{f}` argument 1 is a {}, not a storage",
                other.map_or("missing value".into(), Value::kind)
            ))
        }
    };
    let offset = match a.get(1) {
        Some(Value::Int(i)) => {
            u64::try_from(*i).map_err(|_| format!("`{f}` storage offset {i} is negative"))?
        }
        other => {
            return Err(format!(
                "`{f}` argument 2 (storage offset) is a {}",
                other.map_or("missing value".into(), Value::kind)
            ))
        }
    };
    let shape = dims(&f, "size", a.get(2))?;
    let stride = dims(&f, "stride", a.get(3))?;
    if shape.len() != stride.len() {
        return Err(format!(
            "`{f}` has {} sizes but {} strides",
            shape.len(),
            stride.len()
        ));
    }
    if g == Global::RebuildTensorV2 {
        if !matches!(a.get(4), Some(Value::Bool)) {
            return Err(format!("`{f}` argument 5 (requires_grad) is not a bool"));
        }
        if !matches!(a.get(5), Some(Value::Dict(_))) {
            return Err(format!("`{f}` argument 6 (backward hooks) is not a dict"));
        }
    }
    Ok(Value::Tensor(Rc::new(TensorVal {
        storage,
        offset,
        shape,
        stride,
    })))
}

pub(super) fn dims(f: &str, what: &str, v: Option<&Value>) -> Result<Vec<usize>, String> {
    let Some(Value::Tuple(t)) = v else {
        return Err(format!(
            "`{f}` {what} is a {}, not a tuple",
            v.map_or("missing value".into(), Value::kind)
        ));
    };
    if t.items.len() > MAX_DIMS {
        return Err(format!(
            "`{f}` {what} has {} dimensions (at most {MAX_DIMS})",
            t.items.len()
        ));
    }
    t.items
        .iter()
        .map(|d| match d {
            Value::Int(i) => usize::try_from(*i)
                .map_err(|_| format!("`{f}` {what} holds {i}, not a non-negative integer")),
            other => Err(format!("`{f}` {what} holds a {}", other.kind())),
        })
        .collect()
}

/// `BINPERSID` of `("storage", torch.XStorage, key, location, numel)`.
pub(super) fn persistent_storage(pid: &Value) -> Result<Value, String> {
    let Value::Tuple(t) = pid else {
        return Err(format!(
            "persistent id is a {}, not a storage tuple",
            pid.kind()
        ));
    };
    let [tag, class, key, location, numel] = t.items.as_slice() else {
        return Err(format!(
            "persistent id has {} fields, a storage has 5",
            t.items.len()
        ));
    };
    if !matches!(tag, Value::Str(s) if &**s == "storage") {
        return Err("persistent id is not a storage".into());
    }
    let Value::Global(Global::Storage(dtype)) = class else {
        return Err(format!(
            "storage type is a {}, not a torch storage class",
            class.kind()
        ));
    };
    let Value::Str(key) = key else {
        return Err(format!("storage key is a {}, not a string", key.kind()));
    };
    if key.is_empty()
        || key.len() > MAX_KEY
        || !key
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'.')
            // `data/<key>` names a record: no path tricks.
        || key.contains("..")
    {
        return Err(format!("storage key {key:?} is not a record name"));
    }
    if !matches!(location, Value::Str(_)) {
        return Err("storage location is not a string".into());
    }
    let numel = match numel {
        Value::Int(n) => {
            u64::try_from(*n).map_err(|_| format!("storage of {n} elements is negative"))?
        }
        other => return Err(format!("storage size is a {}", other.kind())),
    };
    Ok(Value::Storage(Rc::new(StorageRef {
        key: key.to_string(),
        dtype: *dtype,
        numel,
    })))
}
