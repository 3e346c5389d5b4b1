// SPDX-License-Identifier: GPL-2.0 OR MIT

//! A small JSON value and its compact, one-line writer (std only).

use std::fmt::{self, Write};

#[derive(Debug, Clone, PartialEq)]
pub enum Json {
    Null,
    Bool(bool),
    Num(u64),
    /// Written with up to 3 decimals; not finite → null.
    Float(f64),
    Str(String),
    Arr(Vec<Json>),
    /// Keys in insertion order.
    Obj(Vec<(String, Json)>),
}

impl Json {
    pub fn str(s: impl Into<String>) -> Self {
        Json::Str(s.into())
    }

    /// An object from (key, value) pairs.
    pub fn obj<K: Into<String>>(pairs: impl IntoIterator<Item = (K, Json)>) -> Self {
        Json::Obj(pairs.into_iter().map(|(k, v)| (k.into(), v)).collect())
    }

    pub fn opt<T>(v: Option<T>, f: impl FnOnce(T) -> Json) -> Self {
        v.map_or(Json::Null, f)
    }
}

/// Writes `s` as a JSON string literal.
fn write_str(out: &mut impl Write, s: &str) -> fmt::Result {
    out.write_char('"')?;
    for c in s.chars() {
        match c {
            '"' => out.write_str("\\\"")?,
            '\\' => out.write_str("\\\\")?,
            '\n' => out.write_str("\\n")?,
            '\r' => out.write_str("\\r")?,
            '\t' => out.write_str("\\t")?,
            '\u{08}' => out.write_str("\\b")?,
            '\u{0c}' => out.write_str("\\f")?,
            c if (c as u32) < 0x20 || c == '\u{7f}' => write!(out, "\\u{:04x}", c as u32)?,
            c => out.write_char(c)?,
        }
    }
    out.write_char('"')
}

impl fmt::Display for Json {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Json::Null => f.write_str("null"),
            Json::Bool(b) => write!(f, "{b}"),
            Json::Num(n) => write!(f, "{n}"),
            Json::Float(x) if x.is_finite() => {
                let s = format!("{x:.3}");
                // Trim "2.500" to "2.5" and "2.000" to "2".
                let s = s.trim_end_matches('0').trim_end_matches('.');
                f.write_str(if s == "-0" { "0" } else { s })
            }
            Json::Float(_) => f.write_str("null"),
            Json::Str(s) => write_str(f, s),
            Json::Arr(items) => {
                f.write_char('[')?;
                for (i, v) in items.iter().enumerate() {
                    if i > 0 {
                        f.write_char(',')?;
                    }
                    write!(f, "{v}")?;
                }
                f.write_char(']')
            }
            Json::Obj(pairs) => {
                f.write_char('{')?;
                for (i, (k, v)) in pairs.iter().enumerate() {
                    if i > 0 {
                        f.write_char(',')?;
                    }
                    write_str(f, k)?;
                    write!(f, ":{v}")?;
                }
                f.write_char('}')
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escaping_and_numbers() {
        let v = Json::obj([
            ("s", Json::str("a\"b\\c\nd\te\u{1}f\u{7f}é")),
            ("n", Json::Num(u64::MAX)),
            ("x", Json::Float(2.5)),
            ("y", Json::Float(3.0)),
            ("z", Json::Float(f64::NAN)),
            ("w", Json::Float(-0.0001)),
            ("a", Json::Arr(vec![Json::Null, Json::Bool(false)])),
            ("o", Json::obj(Vec::<(String, Json)>::new())),
        ]);
        assert_eq!(
            v.to_string(),
            r#"{"s":"a\"b\\c\nd\te\u0001f\u007fé","n":18446744073709551615,"x":2.5,"y":3,"z":null,"w":0,"a":[null,false],"o":{}}"#
        );
    }
}
