//! Python's string semantics where lm-evaluation-harness relies on them:
//! `str.isspace`, `str.strip`, `str.capitalize` and `re.split(r"\s+")`.

/// Python's `str.isspace()`, which is what `\s` matches in a `re` str
/// pattern; wider than Unicode White_Space by U+001C..U+001F.
pub fn py_isspace(c: char) -> bool {
    matches!(
        c,
        '\t'..='\r'
            | '\u{1c}'..='\u{1f}'
            | ' '
            | '\u{85}'
            | '\u{a0}'
            | '\u{1680}'
            | '\u{2000}'..='\u{200a}'
            | '\u{2028}'
            | '\u{2029}'
            | '\u{202f}'
            | '\u{205f}'
            | '\u{3000}'
    )
}

/// `len(re.split(r"\s+", text))`: one more piece than whitespace runs, so
/// leading/trailing whitespace adds an empty piece and "" counts 1.
pub fn count_words(text: &str) -> u64 {
    let mut runs = 0u64;
    let mut in_space = false;
    for c in text.chars() {
        let s = py_isspace(c);
        if s && !in_space {
            runs += 1;
        }
        in_space = s;
    }
    runs + 1
}

/// Python's `str.strip()`.
pub(crate) fn py_strip(s: &str) -> &str {
    s.trim_matches(py_isspace)
}

/// Python's `str.capitalize()`: first character title-cased, the rest lower-cased.
pub fn py_capitalize(s: &str) -> String {
    let mut chars = s.chars();
    let Some(first) = chars.next() else {
        return String::new();
    };
    let mut out = String::with_capacity(s.len());
    match first {
        // The four Latin digraphs have a distinct title case.
        'Ǆ' | 'ǅ' | 'ǆ' => out.push('ǅ'),
        'Ǉ' | 'ǈ' | 'ǉ' => out.push('ǈ'),
        'Ǌ' | 'ǋ' | 'ǌ' => out.push('ǋ'),
        'Ǳ' | 'ǲ' | 'ǳ' => out.push('ǲ'),
        c => {
            // Title case of an expanding character (ß → Ss): upper then lower.
            for (i, u) in c.to_uppercase().enumerate() {
                if i == 0 {
                    out.push(u);
                } else {
                    out.extend(u.to_lowercase());
                }
            }
        }
    }
    out.push_str(&chars.as_str().to_lowercase());
    out
}
