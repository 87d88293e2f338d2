//! `--shard I/N`: one deterministic part of an evaluation's documents or
//! images, used by every evaluation and checked again by `eval merge`.

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// Part `index` of `count`: the items (documents, images) whose index among
/// the selected ones is `index` mod `count`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Shard {
    /// This part, below `count`.
    pub index: usize,
    /// How many parts the run has.
    pub count: usize,
}

impl Shard {
    /// The whole run.
    pub const WHOLE: Shard = Shard { index: 0, count: 1 };

    /// Part `index` of `count`, if `index < count`.
    pub fn new(index: usize, count: usize) -> std::result::Result<Self, String> {
        format!("{index}/{count}").parse()
    }

    /// Whether item `k` belongs to this part (a zero `count` owns nothing).
    pub fn owns(&self, k: usize) -> bool {
        self.count > 0 && k % self.count == self.index
    }

    /// The items of `items` this part owns, in order.
    pub fn select<T: Clone>(&self, items: &[T]) -> Vec<T> {
        items
            .iter()
            .enumerate()
            .filter(|(k, _)| self.owns(*k))
            .map(|(_, x)| x.clone())
            .collect()
    }
}

impl std::str::FromStr for Shard {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let bad = || format!("shard `{s}` is not I/N with 0 <= I < N (e.g. 0/4)");
        let (i, n) = s.split_once('/').ok_or_else(bad)?;
        let (index, count): (usize, usize) = (
            i.trim().parse().map_err(|_| bad())?,
            n.trim().parse().map_err(|_| bad())?,
        );
        if count == 0 || index >= count {
            return Err(bad());
        }
        Ok(Shard { index, count })
    }
}

impl std::fmt::Display for Shard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.index, self.count)
    }
}

/// Checks that `shards` are I/N of one N, each once, all present; returns N.
pub(crate) fn check_shard_set(shards: &[Shard]) -> Result<usize> {
    let Some(first) = shards.first() else {
        return Err(Error::input("no shard results to merge"));
    };
    let n = first.count;
    let mut seen = std::collections::BTreeSet::new();
    for s in shards {
        if s.count != n {
            return Err(Error::input(format!(
                "shard {s} is of {} parts but shard {first} of {n}: results of different shard counts",
                s.count
            )));
        }
        if !seen.insert(s.index) {
            return Err(Error::input(format!("shard {s} appears twice")));
        }
    }
    // Every index is below N and none repeats, so N given means all present;
    // N comes from a file, so the missing ones are named without enumerating 0..N.
    if seen.len() != n {
        let mut missing = Vec::new();
        let mut i = 0;
        while missing.len() < 10 && i < n {
            if !seen.contains(&i) {
                missing.push(format!("{i}/{n}"));
            }
            i += 1;
        }
        return Err(Error::input(format!(
            "{} of {n} shards given: all of them are needed for the whole run; missing {}{}",
            seen.len(),
            missing.join(", "),
            if n - seen.len() > missing.len() {
                ", ..."
            } else {
                ""
            }
        )));
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_partition_the_items() {
        let items: Vec<usize> = (0..7).collect();
        let parts: Vec<Vec<usize>> = (0..3)
            .map(|i| Shard::new(i, 3).unwrap().select(&items))
            .collect();
        assert_eq!(parts, [vec![0, 3, 6], vec![1, 4], vec![2, 5]]);
        assert_eq!(Shard::WHOLE.select(&items), items);
        assert!(Shard { index: 0, count: 0 }.select(&items).is_empty());
        assert_eq!(
            Shard::new(3, 3).unwrap_err(),
            "shard `3/3` is not I/N with 0 <= I < N (e.g. 0/4)"
        );
        assert_eq!("1/4".parse::<Shard>().unwrap().to_string(), "1/4");
    }

    #[test]
    fn a_shard_set_must_be_complete_and_distinct() {
        let set = |v: &[(usize, usize)]| -> Vec<Shard> {
            v.iter()
                .map(|&(index, count)| Shard { index, count })
                .collect()
        };
        assert_eq!(check_shard_set(&set(&[(1, 2), (0, 2)])).unwrap(), 2);
        let e = check_shard_set(&set(&[(0, 3), (2, 3)]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("missing 1/3"), "{e}");
        assert!(check_shard_set(&[]).is_err());
    }
}
