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

mod machine;
mod torch;
mod value;

use std::collections::HashMap;

use candle_core::DType;

use machine::Machine;
use value::Value;

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
    let top = Machine::new(data).run()?;
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
        let mut m = Machine::new(b"\xff\x7f\xff");
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
