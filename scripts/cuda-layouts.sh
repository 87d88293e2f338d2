#!/usr/bin/env bash
# Runs the GPU's plain-op code path on the CPU under candle's CUDA layout rules, to find
# what would fail on a GPU only. candle's CPU matmul takes operands of any strides;
# its CUDA matmul (cuBLAS, `gemm_config` in candle-core's cuda_backend) refuses
# anything but row- or column-major matrices and simple batch strides, and its
# `index_add` a strided destination. Here a copy of candle-core whose CPU backend
# panics (with a backtrace naming the caller) wherever CUDA would refuse is patched in,
# and the tests that CI runs on the GPU's path (TOKENFORMER_KERNELS=none, and the
# training block of train/device_block.rs) run on it.
#
#   bash scripts/cuda-layouts.sh     (~20 minutes cold on 2 cores, 5 warm; its own target dir)
#
# It checks the working tree's tracked files (committed or not) in a copy under
# target/cuda-layouts/. Not in CI: it builds candle and the project a second time.
# Exit 0: no call cuBLAS or candle's CUDA index_add would refuse.
set -euo pipefail
cd "$(dirname "$0")/.."
dir="$PWD/target/cuda-layouts"
mkdir -p "$dir"
registry="${CARGO_HOME:-$HOME/.cargo}/registry/src"
cargo fetch --quiet
version="$(cargo metadata --format-version 1 --locked |
    python3 -c 'import json, sys; print(next(p["version"] for p in json.load(sys.stdin)["packages"] if p["name"] == "candle-core"))')"
src="$(ls -d "$registry"/*/"candle-core-$version" | head -1)"
rm -rf "$dir/candle-core" "$dir/tree"
cp -r "$src" "$dir/candle-core"
python3 - "$dir/candle-core/src/cpu_backend/mod.rs" <<'PY'
import sys
path = sys.argv[1]
s = open(path).read()

def insert_after(anchor, text):
    global s
    if s.count(anchor) < 1:
        sys.exit(f"{path}: `{anchor.strip()}` not found: candle changed, update this script")
    s = s.replace(anchor, anchor + text, 1)

# The matmul: cuBLAS's rules as candle's cuda_backend `gemm_config` applies them.
insert_after("""        let (b, m, n, k) = self.0;
""", """        cuda_layout_audit::matmul((m, n, k), lhs_l, rhs_l);
""")
# index_add: the CUDA backend hands the kernel the destination's own layout, which must
# be contiguous (its `IndexAdd` map).
insert_after("""    fn index_add(
        &self,
        l: &Layout,
        ids: &Self,
        ids_l: &Layout,
        src: &Self,
        src_l: &Layout,
        dim: usize,
    ) -> Result<Self> {
""", """        cuda_layout_audit::contiguous("index_add destination", l);
""")
s += '''
/// The layouts candle's CUDA backend refuses (scripts/cuda-layouts.sh).
mod cuda_layout_audit {
    use crate::Layout;

    fn refuse(what: String) -> ! {
        panic!("CUDA-LAYOUT: {what}\\n{}", std::backtrace::Backtrace::force_capture())
    }

    pub(super) fn contiguous(what: &str, l: &Layout) {
        if l.contiguous_offsets().is_none() {
            refuse(format!("{what} {:?} stride {:?} is not contiguous", l.dims(), l.stride()))
        }
    }

    pub(super) fn matmul((m, n, k): (usize, usize, usize), lhs: &Layout, rhs: &Layout) {
        let (ls, rs) = (lhs.stride(), rhs.stride());
        let (l1, l2) = (ls[ls.len() - 1], ls[ls.len() - 2]);
        let (r1, r2) = (rs[rs.len() - 1], rs[rs.len() - 2]);
        let rhs_ok = ((r1 == 1 || n == 1) && (r2 == n || k == 1))
            || ((r1 == k || n == 1) && (r2 == 1 || k == 1));
        let lhs_ok = ((l1 == 1 || k == 1) && (l2 == k || m == 1))
            || ((l1 == m || k == 1) && (l2 == 1 || m == 1));
        let batch_ok = |l: &Layout| {
            let st = l.stride();
            match st[..st.len() - 2] {
                [s1, s2] => s1 == s2 * l.dims()[1] || l.dims()[0] == 1 || l.dims()[1] == 1,
                [_] | [] => true,
                _ => false,
            }
        };
        if !(lhs_ok && rhs_ok && batch_ok(lhs) && batch_ok(rhs)) {
            refuse(format!(
                "cuBLAS would refuse this matmul: lhs {:?} stride {:?}, rhs {:?} stride {:?}",
                lhs.dims(), ls, rhs.dims(), rs
            ))
        }
    }
}
'''
open(path, "w").write(s)
PY
# The working tree's tracked files, with candle-core replaced by the audited copy.
mkdir -p "$dir/tree"
git ls-files -z | xargs -0 tar -c --ignore-failed-read 2>/dev/null | tar -x -C "$dir/tree"
printf '\n[patch.crates-io]\ncandle-core = { path = "%s" }\n' "$dir/candle-core" >>"$dir/tree/Cargo.toml"
cd "$dir/tree"
export CARGO_TARGET_DIR="$dir/target" RUST_BACKTRACE=0
log="$dir/log.txt"
: >"$log"
# vision's pooling test computes its independent reference with row views on the CPU:
# not a path that runs on a GPU.
skip=(-- --skip cls_and_mean_pooling_match_an_independent_reference)
status=0
TOKENFORMER_KERNELS=none cargo test --release --workspace --no-fail-fast --test lm \
    --test precision --test train --test train_vit --test train_vl --test vision --test vl \
    --test eval --test zoo_trained "${skip[@]}" >>"$log" 2>&1 || status=1
TOKENFORMER_DEVICE_BLOCK=cpu TOKENFORMER_KERNELS=none cargo test --release --workspace \
    --no-fail-fast --test train --test train_vit >>"$log" 2>&1 || status=1
grep -A12 '^CUDA-LAYOUT' "$log" | grep -v ' at \|std::\|core::\|candle_core::' || true
grep 'test result' "$log"
if [ "$status" != 0 ]; then
    echo "error: a test failed under CUDA's layout rules (log: $log)" >&2
    exit 1
fi
echo "no layout that candle's CUDA backend refuses"
