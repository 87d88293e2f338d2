//! The pickle machine: opcodes read with every length and count checked,
//! a bounded stack, marks and memo; `REDUCE` only on allowed globals.

use std::collections::HashMap;
use std::rc::Rc;

use super::torch::*;
use super::value::*;
use super::*;

pub(super) struct Machine<'a> {
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
    pub(super) fn new(data: &'a [u8]) -> Self {
        Self {
            data,
            pos: 0,
            stack: Vec::new(),
            marks: Vec::new(),
            memo: HashMap::new(),
            budget: MAX_VALUES,
        }
    }

    pub(super) fn run(&mut self) -> Result<Value, String> {
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
    pub(super) fn long(&mut self, n: usize) -> Result<Value, String> {
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

pub(super) fn op_name(op: u8) -> String {
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
