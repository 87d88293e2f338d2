//! A restricted, bounded reader for the pickle of a torch zip checkpoint
//! (`data.pkl`). It knows the opcodes `torch.save` writes for a state dict
//! (protocol 2, and the protocol 3–5 forms of the same values) and an
//! allow-list of globals: the dict types and the tensor-rebuild functions a
//! state dict names. Nothing is ever called: allowed globals are interpreted,
//! any other global is refused by name, and objects can only be built by
//! `REDUCE` on an allowed function. Nesting depth, marks, memo entries and the
//! number of values built are bounded, and every read is checked, so a hostile
//! pickle ends in an error — never a panic, a stack overflow or an unbounded
//! allocation. Reference: CPython `Lib/pickletools.py` (opcodes) and
//! `torch/_utils.py` (`_rebuild_tensor_v2` and friends).

use std::collections::HashMap;
use std::rc::Rc;

use candle_core::DType;

/// Deepest nesting of containers (a state dict needs about 4) and of marks.
pub(crate) const MAX_DEPTH: usize = 64;
/// Values built, memoised or copied in all (a state dict needs about 20 per
/// tensor); this bounds memory and time whatever the pickle says.
pub(crate) const MAX_VALUES: usize = 1 << 21;
/// Entries of the memo.
pub(crate) const MAX_MEMO: usize = 1 << 20;
/// Dimensions of one tensor.
pub(crate) const MAX_DIMS: usize = 32;
/// Longest `GLOBAL` module or name line.
const MAX_GLOBAL_LINE: usize = 256;
/// Longest storage key (torch writes decimal numbers).
const MAX_KEY: usize = 128;

/// One tensor of the state dict: a view (offset, shape, stride, in elements)
/// of a storage whose bytes are the zip record `data/<key>`.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct PickledTensor {
    pub name: String,
    pub storage_key: String,
    pub dtype: DType,
    /// Elements of the storage, as the pickle declares it.
    pub storage_numel: u64,
    pub offset: u64,
    pub shape: Vec<usize>,
    pub stride: Vec<usize>,
}

/// The tensors of the pickled state dict (a `dict` or `OrderedDict` whose
/// values are tensors; entries that are not tensors are skipped), in pickle
/// order. Errors say which byte and which opcode, global or argument is wrong.
pub(crate) fn state_dict(data: &[u8]) -> Result<Vec<PickledTensor>, String> {
    let mut m = Machine {
        data,
        pos: 0,
        stack: Vec::new(),
        marks: Vec::new(),
        memo: HashMap::new(),
        budget: MAX_VALUES,
    };
    let top = m.run()?;
    let Value::Dict(dict) = top else {
        return Err(format!(
            "the pickle holds a {}, not a state dict (a dict of tensors)",
            top.kind()
        ));
    };
    let mut out = Vec::new();
    let mut names = std::collections::HashSet::new();
    let mut storages: HashMap<&str, (DType, u64)> = HashMap::new();
    for (i, (k, v)) in dict.items.iter().enumerate() {
        let Value::Str(name) = k else {
            return Err(format!(
                "key {i} of the state dict is a {}, not a string",
                k.kind()
            ));
        };
        let Value::Tensor(t) = v else { continue };
        if !names.insert(name.clone()) {
            return Err(format!("tensor `{name}` appears twice"));
        }
        let s = &t.storage;
        match storages.insert(&s.key, (s.dtype, s.numel)) {
            Some(prev) if prev != (s.dtype, s.numel) => {
                return Err(format!(
                    "storage `{}` is declared as {:?} × {} and as {:?} × {}",
                    s.key, prev.0, prev.1, s.dtype, s.numel
                ))
            }
            _ => {}
        }
        out.push(PickledTensor {
            name: name.to_string(),
            storage_key: s.key.clone(),
            dtype: s.dtype,
            storage_numel: s.numel,
            offset: t.offset,
            shape: t.shape.clone(),
            stride: t.stride.clone(),
        });
    }
    Ok(out)
}

/// The globals a state dict may name. Only the functions are ever applied
/// (by [`Machine::reduce`], which interprets them); the classes are markers.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Global {
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
    fn resolve(module: &str, name: &str) -> Result<Self, String> {
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

    fn name(self) -> String {
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

/// A storage persistent id: `("storage", torch.HalfStorage, key, location, numel)`.
#[derive(Debug)]
struct StorageRef {
    key: String,
    dtype: DType,
    numel: u64,
}

#[derive(Debug)]
struct TensorVal {
    storage: Rc<StorageRef>,
    offset: u64,
    shape: Vec<usize>,
    stride: Vec<usize>,
}

/// Containers are shared (`Rc`) so that memo gets and `DUP` cost nothing;
/// a shared container is copied before it is changed (counted in the budget).
#[derive(Clone, Debug)]
enum Value {
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
struct Seq {
    depth: usize,
    items: Vec<Value>,
}

#[derive(Clone, Debug, Default)]
struct Map {
    depth: usize,
    items: Vec<(Value, Value)>,
}

impl Value {
    fn kind(&self) -> String {
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
    fn depth(&self) -> usize {
        match self {
            Value::Tuple(s) | Value::List(s) => s.depth,
            Value::Dict(m) => m.depth,
            Value::Tensor(_) => 1,
            _ => 0,
        }
    }
}

fn seq(items: Vec<Value>) -> Result<Rc<Seq>, String> {
    let depth = 1 + items.iter().map(Value::depth).max().unwrap_or(0);
    check_depth(depth)?;
    Ok(Rc::new(Seq { depth, items }))
}

fn check_depth(depth: usize) -> Result<(), String> {
    if depth > MAX_DEPTH {
        return Err(format!("containers nested deeper than {MAX_DEPTH}"));
    }
    Ok(())
}

fn pairs(items: Vec<Value>) -> Result<Vec<(Value, Value)>, String> {
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

struct Machine<'a> {
    data: &'a [u8],
    pos: usize,
    stack: Vec<Value>,
    /// Stack lengths at each `MARK`.
    marks: Vec<usize>,
    memo: HashMap<u32, Value>,
    /// Values that may still be built.
    budget: usize,
}

impl<'a> Machine<'a> {
    fn run(&mut self) -> Result<Value, String> {
        loop {
            let at = self.pos;
            let op = self.u8().map_err(|e| format!("byte {at}: {e}"))?;
            match self.step(op) {
                Ok(Some(v)) => return Ok(v),
                Ok(None) => {}
                Err(e) => return Err(format!("byte {at} (opcode {}): {e}", op_name(op))),
            }
        }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        let data = self.data;
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= data.len())
            .ok_or_else(|| {
                format!(
                    "needs {n} bytes but the pickle ends after {}",
                    data.len().saturating_sub(self.pos)
                )
            })?;
        let s = data.get(self.pos..end).ok_or("out of range")?;
        self.pos = end;
        Ok(s)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], String> {
        let s = self.take(N)?;
        s.try_into().map_err(|_| "short read".to_string())
    }

    fn u8(&mut self) -> Result<u8, String> {
        Ok(self.array::<1>()?[0])
    }

    fn u32(&mut self) -> Result<u32, String> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    fn len_u64(&mut self) -> Result<usize, String> {
        let n = u64::from_le_bytes(self.array()?);
        usize::try_from(n).map_err(|_| format!("length {n} is too large"))
    }

    fn str_of(&mut self, n: usize) -> Result<Value, String> {
        let s = self.take(n)?;
        let s = std::str::from_utf8(s).map_err(|e| format!("string is not UTF-8: {e}"))?;
        Ok(Value::Str(Rc::from(s)))
    }

    /// A `\n`-terminated line of a text opcode (`GLOBAL`).
    fn line(&mut self) -> Result<&'a str, String> {
        let rest = self.data.get(self.pos..).unwrap_or_default();
        let window = rest
            .get(..rest.len().min(MAX_GLOBAL_LINE + 1))
            .unwrap_or(rest);
        let n = window
            .iter()
            .position(|&b| b == b'\n')
            .ok_or_else(|| format!("no end of line within {MAX_GLOBAL_LINE} bytes"))?;
        let line = self.take(n)?;
        self.take(1)?;
        std::str::from_utf8(line).map_err(|_| "line is not UTF-8".to_string())
    }

    fn charge(&mut self, n: usize) -> Result<(), String> {
        self.budget = self.budget.checked_sub(n).ok_or_else(|| {
            format!("builds more than {MAX_VALUES} values (no state dict needs that many)")
        })?;
        Ok(())
    }

    fn push(&mut self, v: Value) -> Result<(), String> {
        self.charge(1)?;
        self.stack.push(v);
        Ok(())
    }

    /// Stack length below which the current mark forbids popping.
    fn floor(&self) -> usize {
        self.marks.last().copied().unwrap_or(0)
    }

    fn pop(&mut self) -> Result<Value, String> {
        if self.stack.len() <= self.floor() {
            return Err("stack underflow".into());
        }
        self.stack.pop().ok_or_else(|| "stack underflow".into())
    }

    fn pop_n(&mut self, n: usize) -> Result<Vec<Value>, String> {
        let start = self
            .stack
            .len()
            .checked_sub(n)
            .filter(|&s| s >= self.floor())
            .ok_or("stack underflow")?;
        Ok(self.stack.split_off(start))
    }

    fn pop_mark(&mut self) -> Result<Vec<Value>, String> {
        let m = self.marks.pop().ok_or("no mark to pop to")?;
        if m > self.stack.len() {
            return Err("mark above the stack".into());
        }
        Ok(self.stack.split_off(m))
    }

    fn top(&self) -> Result<&Value, String> {
        if self.stack.len() <= self.floor() {
            return Err("stack underflow".into());
        }
        self.stack.last().ok_or_else(|| "stack underflow".into())
    }

    /// The list on top of the stack, copied first if it is shared.
    fn top_list(&mut self) -> Result<&mut Seq, String> {
        let shared = match self.top()? {
            Value::List(l) => (Rc::strong_count(l) > 1).then_some(l.items.len()),
            other => return Err(format!("appends to a {}, not a list", other.kind())),
        };
        if let Some(n) = shared {
            self.charge(n)?;
        }
        match self.stack.last_mut() {
            Some(Value::List(l)) => Ok(Rc::make_mut(l)),
            _ => Err("stack underflow".into()),
        }
    }

    /// The dict on top of the stack, copied first if it is shared.
    fn top_dict(&mut self) -> Result<&mut Map, String> {
        let shared = match self.top()? {
            Value::Dict(d) => (Rc::strong_count(d) > 1).then_some(d.items.len()),
            other => return Err(format!("sets items of a {}, not a dict", other.kind())),
        };
        if let Some(n) = shared {
            self.charge(n)?;
        }
        match self.stack.last_mut() {
            Some(Value::Dict(d)) => Ok(Rc::make_mut(d)),
            _ => Err("stack underflow".into()),
        }
    }

    fn append(&mut self, items: Vec<Value>) -> Result<(), String> {
        let deepest = items.iter().map(Value::depth).max().unwrap_or(0);
        check_depth(deepest + 1)?;
        let list = self.top_list()?;
        list.depth = list.depth.max(deepest + 1);
        list.items.extend(items);
        Ok(())
    }

    fn set_items(&mut self, items: Vec<(Value, Value)>) -> Result<(), String> {
        let deepest = items
            .iter()
            .map(|(k, v)| k.depth().max(v.depth()))
            .max()
            .unwrap_or(0);
        check_depth(deepest + 1)?;
        let dict = self.top_dict()?;
        dict.depth = dict.depth.max(deepest + 1);
        dict.items.extend(items);
        Ok(())
    }

    fn memo_put(&mut self, idx: u32) -> Result<(), String> {
        let v = self.top()?.clone();
        if self.memo.len() >= MAX_MEMO && !self.memo.contains_key(&idx) {
            return Err(format!("more than {MAX_MEMO} memo entries"));
        }
        self.charge(1)?;
        self.memo.insert(idx, v);
        Ok(())
    }

    fn memo_get(&mut self, idx: u32) -> Result<(), String> {
        let v = self
            .memo
            .get(&idx)
            .cloned()
            .ok_or_else(|| format!("memo entry {idx} was never stored"))?;
        self.push(v)
    }

    fn global(&mut self, module: &str, name: &str) -> Result<(), String> {
        let g = Global::resolve(module, name)?;
        self.push(Value::Global(g))
    }

    /// One opcode; `Some(result)` at `STOP`.
    fn step(&mut self, op: u8) -> Result<Option<Value>, String> {
        match op {
            0x80 => {
                let v = self.u8()?;
                if !(2..=5).contains(&v) {
                    return Err(format!(
                        "protocol {v} is not one torch.save writes (2 to 5)"
                    ));
                }
            }
            0x95 => {
                self.take(8)?; // FRAME: a length hint only
            }
            b'.' => {
                if !self.marks.is_empty() {
                    return Err("STOP inside an open mark".into());
                }
                return self.pop().map(Some);
            }
            b'(' => {
                if self.marks.len() >= MAX_DEPTH {
                    return Err(format!("more than {MAX_DEPTH} nested marks"));
                }
                self.marks.push(self.stack.len());
            }
            b'0' => {
                self.pop()?;
            }
            b'1' => {
                self.pop_mark()?;
            }
            b'2' => {
                let v = self.top()?.clone();
                self.push(v)?;
            }
            b'N' => self.push(Value::None)?,
            0x88 | 0x89 => self.push(Value::Bool)?,
            b'J' => {
                let v = i32::from_le_bytes(self.array()?);
                self.push(Value::Int(v.into()))?
            }
            b'K' => {
                let v = self.u8()?;
                self.push(Value::Int(v.into()))?
            }
            b'M' => {
                let v = u16::from_le_bytes(self.array()?);
                self.push(Value::Int(v.into()))?
            }
            0x8a => {
                let n = usize::from(self.u8()?);
                let v = self.long(n)?;
                self.push(v)?
            }
            0x8b => {
                let n = self.u32()? as usize;
                let v = self.long(n)?;
                self.push(v)?
            }
            b'G' => {
                self.take(8)?;
                self.push(Value::Float)?
            }
            b'X' => {
                let n = self.u32()? as usize;
                let v = self.str_of(n)?;
                self.push(v)?
            }
            0x8c => {
                let n = usize::from(self.u8()?);
                let v = self.str_of(n)?;
                self.push(v)?
            }
            0x8d => {
                let n = self.len_u64()?;
                let v = self.str_of(n)?;
                self.push(v)?
            }
            b'B' => {
                let n = self.u32()? as usize;
                self.take(n)?;
                self.push(Value::Bytes)?
            }
            b'C' => {
                let n = usize::from(self.u8()?);
                self.take(n)?;
                self.push(Value::Bytes)?
            }
            0x8e => {
                let n = self.len_u64()?;
                self.take(n)?;
                self.push(Value::Bytes)?
            }
            b')' => self.push(Value::Tuple(Rc::default()))?,
            b't' => {
                let items = self.pop_mark()?;
                self.push(Value::Tuple(seq(items)?))?
            }
            0x85..=0x87 => {
                let items = self.pop_n(usize::from(op - 0x84))?;
                self.push(Value::Tuple(seq(items)?))?
            }
            b']' => self.push(Value::List(Rc::default()))?,
            b'l' => {
                let items = self.pop_mark()?;
                self.push(Value::List(seq(items)?))?
            }
            b'a' => {
                let v = self.pop()?;
                self.append(vec![v])?
            }
            b'e' => {
                let items = self.pop_mark()?;
                self.append(items)?
            }
            b'}' => self.push(Value::Dict(Rc::default()))?,
            b'd' => {
                let items = pairs(self.pop_mark()?)?;
                let depth = 1 + items
                    .iter()
                    .map(|(k, v)| k.depth().max(v.depth()))
                    .max()
                    .unwrap_or(0);
                check_depth(depth)?;
                self.push(Value::Dict(Rc::new(Map { depth, items })))?
            }
            b's' => {
                let v = self.pop()?;
                let k = self.pop()?;
                self.set_items(vec![(k, v)])?
            }
            b'u' => {
                let items = pairs(self.pop_mark()?)?;
                self.set_items(items)?
            }
            b'q' => {
                let i = self.u8()?;
                self.memo_put(i.into())?
            }
            b'r' => {
                let i = self.u32()?;
                self.memo_put(i)?
            }
            0x94 => {
                let i = u32::try_from(self.memo.len()).map_err(|_| "memo is full")?;
                self.memo_put(i)?
            }
            b'h' => {
                let i = self.u8()?;
                self.memo_get(i.into())?
            }
            b'j' => {
                let i = self.u32()?;
                self.memo_get(i)?
            }
            b'c' => {
                let module = self.line()?;
                let name = self.line()?;
                self.global(module, name)?
            }
            0x93 => {
                let name = self.pop()?;
                let module = self.pop()?;
                match (&module, &name) {
                    (Value::Str(m), Value::Str(n)) => self.global(m, n)?,
                    _ => return Err("STACK_GLOBAL needs two strings".into()),
                }
            }
            b'R' => {
                let args = self.pop()?;
                let func = self.pop()?;
                let v = self.reduce(&func, &args)?;
                self.push(v)?
            }
            b'b' => {
                let _state = self.pop()?;
                match self.top()? {
                    // An OrderedDict's attributes (`_metadata`) or a
                    // parameter's state: neither matters for the weights.
                    Value::Dict(_) | Value::Tensor(_) => {}
                    other => {
                        return Err(format!(
                            "BUILD (setting the state of) a {} is not allowed",
                            other.kind()
                        ))
                    }
                }
            }
            b'Q' => {
                let pid = self.pop()?;
                let v = persistent_storage(&pid)?;
                self.push(v)?
            }
            0x81 | 0x92 | b'i' | b'o' | 0x82..=0x84 => {
                return Err("creating objects is not allowed in a state dict".into())
            }
            _ => return Err("not an opcode a torch state dict uses".into()),
        }
        Ok(None)
    }

    /// LONG1/LONG4: little-endian two's complement; up to 8 bytes.
    fn long(&mut self, n: usize) -> Result<Value, String> {
        if n > 8 {
            return Err(format!("an integer of {n} bytes is too large"));
        }
        let bytes = self.take(n)?;
        let mut buf = match bytes.last() {
            Some(&b) if b & 0x80 != 0 => [0xFFu8; 8],
            _ => [0u8; 8],
        };
        buf.get_mut(..n)
            .ok_or("integer too large")?
            .copy_from_slice(bytes);
        Ok(Value::Int(i64::from_le_bytes(buf)))
    }

    /// `REDUCE`: only the allowed functions, interpreted here.
    fn reduce(&mut self, func: &Value, args: &Value) -> Result<Value, String> {
        let Value::Global(g) = func else {
            return Err(format!("calls a {}, which is not callable", func.kind()));
        };
        let Value::Tuple(args) = args else {
            return Err(format!(
                "`{}` is called with a {} instead of an argument tuple",
                g.name(),
                args.kind()
            ));
        };
        let a = &args.items;
        let arity = |ok: bool, want: &str| -> Result<(), String> {
            if ok {
                Ok(())
            } else {
                Err(format!(
                    "`{}` takes {want} arguments, got {}",
                    g.name(),
                    a.len()
                ))
            }
        };
        match g {
            Global::OrderedDict => {
                arity(a.is_empty(), "no")?;
                Ok(Value::Dict(Rc::default()))
            }
            Global::RebuildTensorV2 => {
                arity((6..=7).contains(&a.len()), "6 or 7")?;
                rebuild_tensor(*g, a)
            }
            Global::RebuildTensor => {
                arity(a.len() == 4, "4")?;
                rebuild_tensor(*g, a)
            }
            Global::RebuildParameter | Global::RebuildParameterWithState => {
                let n = if *g == Global::RebuildParameter { 3 } else { 4 };
                arity(a.len() == n, &n.to_string())?;
                match a.first() {
                    Some(t @ Value::Tensor(_)) => Ok(t.clone()),
                    Some(other) => Err(format!(
                        "`{}` argument 1 is a {}, not a tensor",
                        g.name(),
                        other.kind()
                    )),
                    None => Err("no arguments".into()),
                }
            }
            Global::RebuildFromTypeV2 => {
                arity(a.len() == 4, "4")?;
                let (Some(inner), Some(ty), Some(inner_args)) = (a.first(), a.get(1), a.get(2))
                else {
                    return Err("short argument tuple".into());
                };
                match ty {
                    Value::Global(Global::TensorClass | Global::ParameterClass) => {}
                    other => {
                        return Err(format!(
                            "`{}` rebuilds a {}, not a tensor",
                            g.name(),
                            other.kind()
                        ))
                    }
                }
                match inner {
                    Value::Global(
                        Global::RebuildTensorV2
                        | Global::RebuildTensor
                        | Global::RebuildParameter
                        | Global::RebuildParameterWithState,
                    ) => self.reduce(inner, inner_args),
                    other => Err(format!(
                        "`{}` applies a {}, not a tensor-rebuild function",
                        g.name(),
                        other.kind()
                    )),
                }
            }
            Global::TensorClass | Global::ParameterClass | Global::Storage(_) => {
                Err(format!("`{}` may not be called", g.name()))
            }
        }
    }
}

/// `_rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad,
/// backward_hooks[, metadata])` or `_rebuild_tensor(storage, offset, size, stride)`.
fn rebuild_tensor(g: Global, a: &[Value]) -> Result<Value, String> {
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

fn dims(f: &str, what: &str, v: Option<&Value>) -> Result<Vec<usize>, String> {
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
fn persistent_storage(pid: &Value) -> Result<Value, String> {
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

fn op_name(op: u8) -> String {
    let name = match op {
        0x80 => "PROTO",
        0x95 => "FRAME",
        b'.' => "STOP",
        b'(' => "MARK",
        b'0' => "POP",
        b'1' => "POP_MARK",
        b'2' => "DUP",
        b'N' => "NONE",
        0x88 => "NEWTRUE",
        0x89 => "NEWFALSE",
        b'J' => "BININT",
        b'K' => "BININT1",
        b'M' => "BININT2",
        0x8a => "LONG1",
        0x8b => "LONG4",
        b'G' => "BINFLOAT",
        b'X' => "BINUNICODE",
        0x8c => "SHORT_BINUNICODE",
        0x8d => "BINUNICODE8",
        b'B' => "BINBYTES",
        b'C' => "SHORT_BINBYTES",
        0x8e => "BINBYTES8",
        b')' => "EMPTY_TUPLE",
        b't' => "TUPLE",
        0x85 => "TUPLE1",
        0x86 => "TUPLE2",
        0x87 => "TUPLE3",
        b']' => "EMPTY_LIST",
        b'l' => "LIST",
        b'a' => "APPEND",
        b'e' => "APPENDS",
        b'}' => "EMPTY_DICT",
        b'd' => "DICT",
        b's' => "SETITEM",
        b'u' => "SETITEMS",
        b'q' => "BINPUT",
        b'r' => "LONG_BINPUT",
        0x94 => "MEMOIZE",
        b'h' => "BINGET",
        b'j' => "LONG_BINGET",
        b'c' => "GLOBAL",
        0x93 => "STACK_GLOBAL",
        b'R' => "REDUCE",
        b'b' => "BUILD",
        b'Q' => "BINPERSID",
        b'P' => "PERSID",
        0x81 => "NEWOBJ",
        0x92 => "NEWOBJ_EX",
        b'i' => "INST",
        b'o' => "OBJ",
        0x82..=0x84 => "EXT",
        b'I' => "INT",
        b'L' => "LONG",
        b'F' => "FLOAT",
        b'S' => "STRING",
        b'V' => "UNICODE",
        b'T' => "BINSTRING",
        b'U' => "SHORT_BINSTRING",
        b'p' => "PUT",
        b'g' => "GET",
        0x8f => "EMPTY_SET",
        0x90 => "ADDITEMS",
        0x91 => "FROZENSET",
        0x96 => "BYTEARRAY8",
        0x97 => "NEXT_BUFFER",
        0x98 => "READONLY_BUFFER",
        _ => return format!("0x{op:02x}"),
    };
    format!("{name} 0x{op:02x}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn unicode(s: &str) -> Vec<u8> {
        let mut v = vec![0x8c, s.len() as u8];
        v.extend_from_slice(s.as_bytes());
        v
    }

    /// A protocol-4 state dict as `torch.save(..., pickle_protocol=4)` of
    /// `model.state_dict()` writes it: FRAME, SHORT_BINUNICODE, MEMOIZE,
    /// STACK_GLOBAL, an `OrderedDict` with `_metadata` set by BUILD, a
    /// parameter wrapped by `_rebuild_parameter`, a tensor through
    /// `_rebuild_from_type_v2`, and a non-tensor entry that is skipped.
    #[test]
    fn protocol_4_state_dict_with_parameters_and_metadata() {
        let mut p = vec![0x80, 4, 0x95];
        p.extend_from_slice(&0u64.to_le_bytes());
        let global = |p: &mut Vec<u8>, m: &str, n: &str| {
            p.extend(unicode(m));
            p.extend(unicode(n));
            p.extend([0x93, 0x94]);
        };
        global(&mut p, "collections", "OrderedDict");
        p.extend(b")R\x94(");
        // "w": _rebuild_parameter(_rebuild_tensor_v2(storage, 2, (2, 3), (3, 1), False, {}), True, {})
        p.extend(unicode("w"));
        global(&mut p, "torch._utils", "_rebuild_parameter");
        p.push(b'(');
        global(&mut p, "torch._utils", "_rebuild_tensor_v2");
        p.extend(b"((");
        p.extend(unicode("storage"));
        global(&mut p, "torch", "BFloat16Storage");
        p.extend(unicode("17"));
        p.extend(unicode("cuda:0"));
        p.extend(b"K\x08tQK\x02K\x02K\x03\x86K\x03K\x01\x86\x89}tR\x88}tR");
        // "v": _rebuild_from_type_v2(_rebuild_tensor_v2, torch.Tensor, (...), {})
        p.extend(unicode("v"));
        global(&mut p, "torch._tensor", "_rebuild_from_type_v2");
        p.push(b'(');
        global(&mut p, "torch._utils", "_rebuild_tensor_v2");
        global(&mut p, "torch", "Tensor");
        p.extend(b"((");
        p.extend(unicode("storage"));
        global(&mut p, "torch", "LongStorage");
        p.extend(unicode("3"));
        p.extend(unicode("cpu"));
        p.extend(b"K\x04tQK\x00K\x04\x85K\x01\x85\x89}t}tR");
        // "step": a plain int, skipped.
        p.extend(unicode("step"));
        p.extend(b"\x8a\x02\x00\xffu");
        // _metadata = {"": {"version": 1}}
        p.push(b'}');
        p.extend(unicode("_metadata"));
        p.push(b'}');
        p.extend(unicode(""));
        p.push(b'}');
        p.extend(unicode("version"));
        p.extend(b"K\x01sssb.");
        let t = state_dict(&p).unwrap();
        assert_eq!(
            t,
            vec![
                PickledTensor {
                    name: "w".into(),
                    storage_key: "17".into(),
                    dtype: DType::BF16,
                    storage_numel: 8,
                    offset: 2,
                    shape: vec![2, 3],
                    stride: vec![3, 1],
                },
                PickledTensor {
                    name: "v".into(),
                    storage_key: "3".into(),
                    dtype: DType::I64,
                    storage_numel: 4,
                    offset: 0,
                    shape: vec![4],
                    stride: vec![1],
                },
            ]
        );
    }

    #[test]
    fn long_integers_are_twos_complement() {
        let mut m = Machine {
            data: b"\xff\x7f\xff",
            pos: 0,
            stack: vec![],
            marks: vec![],
            memo: HashMap::new(),
            budget: 10,
        };
        assert!(matches!(m.long(2), Ok(Value::Int(0x7fff))));
        assert!(matches!(m.long(1), Ok(Value::Int(-1))));
        assert!(matches!(m.long(0), Ok(Value::Int(0))));
        assert!(m.long(9).is_err());
    }

    #[test]
    fn a_storage_declared_twice_differently_is_refused() {
        let tensor = |class: &str, numel: u8| {
            let mut p =
                b"ctorch._utils\n_rebuild_tensor_v2\n((X\x07\x00\x00\x00storagectorch\n".to_vec();
            p.extend_from_slice(class.as_bytes());
            p.extend_from_slice(b"\nX\x01\x00\x00\x000X\x03\x00\x00\x00cpuK");
            p.push(numel);
            p.extend_from_slice(b"tQK\x00(K\x01t(K\x01t\x89}tR");
            p
        };
        let mut p = b"\x80\x02}(X\x01\x00\x00\x00a".to_vec();
        p.extend(tensor("FloatStorage", 4));
        p.extend(b"X\x01\x00\x00\x00b");
        p.extend(tensor("HalfStorage", 4));
        p.extend(b"u.");
        let e = state_dict(&p).unwrap_err();
        assert!(e.contains("storage `0` is declared as"), "{e}");
    }
}
