//! The values the restricted machine builds, with their bounds.

use std::rc::Rc;

use candle_core::DType;

use super::torch::*;
use super::*;

/// A storage persistent id: `("storage", torch.HalfStorage, key, location, numel)`.
#[derive(Debug)]
pub(super) struct StorageRef {
    pub(super) key: String,
    pub(super) dtype: DType,
    pub(super) numel: u64,
}

#[derive(Debug)]
pub(super) struct TensorVal {
    pub(super) storage: Rc<StorageRef>,
    pub(super) offset: u64,
    pub(super) shape: Vec<usize>,
    pub(super) stride: Vec<usize>,
}

/// Containers are shared (`Rc`) so that memo gets and `DUP` cost nothing;
/// a shared container is copied before it is changed (counted in the budget).
#[derive(Clone, Debug)]
pub(super) enum Value {
    None,
    Bool,
    Int(i64),
    Float,
    Str(Rc<str>),
    Bytes,
    Tuple(Rc<Seq>),
    List(Rc<Seq>),
    Dict(Rc<Map>),
    Global(Global),
    Storage(Rc<StorageRef>),
    Tensor(Rc<TensorVal>),
}

#[derive(Clone, Debug, Default)]
pub(super) struct Seq {
    pub(super) depth: usize,
    pub(super) items: Vec<Value>,
}

#[derive(Clone, Debug, Default)]
pub(super) struct Map {
    pub(super) depth: usize,
    pub(super) items: Vec<(Value, Value)>,
}

impl Value {
    pub(super) fn kind(&self) -> String {
        match self {
            Value::None => "None".into(),
            Value::Bool => "bool".into(),
            Value::Int(_) => "int".into(),
            Value::Float => "float".into(),
            Value::Str(_) => "str".into(),
            Value::Bytes => "bytes".into(),
            Value::Tuple(_) => "tuple".into(),
            Value::List(_) => "list".into(),
            Value::Dict(_) => "dict".into(),
            Value::Global(g) => format!("global `{}`", g.name()),
            Value::Storage(_) => "storage".into(),
            Value::Tensor(_) => "tensor".into(),
        }
    }

    /// Nesting depth: 0 for scalars, 1 + the deepest item for containers.
    pub(super) fn depth(&self) -> usize {
        match self {
            Value::Tuple(s) | Value::List(s) => s.depth,
            Value::Dict(m) => m.depth,
            Value::Tensor(_) => 1,
            _ => 0,
        }
    }
}

pub(super) fn seq(items: Vec<Value>) -> Result<Rc<Seq>, String> {
    let depth = 1 + items.iter().map(Value::depth).max().unwrap_or(0);
    check_depth(depth)?;
    Ok(Rc::new(Seq { depth, items }))
}

pub(super) fn check_depth(depth: usize) -> Result<(), String> {
    if depth > MAX_DEPTH {
        return Err(format!("containers nested deeper than {MAX_DEPTH}"));
    }
    Ok(())
}

pub(super) fn pairs(items: Vec<Value>) -> Result<Vec<(Value, Value)>, String> {
    if !items.len().is_multiple_of(2) {
        return Err(format!("{} items cannot be key/value pairs", items.len()));
    }
    let mut out = Vec::with_capacity(items.len() / 2);
    let mut it = items.into_iter();
    while let (Some(k), Some(v)) = (it.next(), it.next()) {
        out.push((k, v));
    }
    Ok(out)
}
