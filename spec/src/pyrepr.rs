//! Python literals as engines print them in their logs (`repr` of a dict of args), read into
//! JSON: dicts, lists and tuples, strings in either quote, ints, floats, `True`, `False`,
//! `None`. Anything else (`<Mode.NONE: 0>`, `PosixPath('/m')`, `SpeculativeConfig(…)`) is kept
//! as its text, a string.

use serde_json::{Map, Number, Value};

/// The Python literal at the start of `text` (what follows it is ignored), or why it is not one.
pub fn parse(text: &str) -> Result<Value, String> {
    let mut p = Parser { s: text.as_bytes(), text, i: 0 };
    p.ws();
    p.value()
}

struct Parser<'a> {
    s: &'a [u8],
    text: &'a str,
    i: usize,
}

impl Parser<'_> {
    fn ws(&mut self) {
        while self.s.get(self.i).is_some_and(|b| b.is_ascii_whitespace()) {
            self.i += 1;
        }
    }

    fn err(&self, what: &str) -> String {
        format!("{what} at byte {} of a Python literal", self.i)
    }

    fn value(&mut self) -> Result<Value, String> {
        match self.s.get(self.i) {
            None => Err(self.err("the text ends")),
            Some(b'{') => self.dict(),
            Some(b'[') => self.seq(b']'),
            Some(b'(') => self.seq(b')'),
            Some(b'\'' | b'"') => self.string().map(Value::String),
            Some(_) => Ok(self.word()),
        }
    }

    fn dict(&mut self) -> Result<Value, String> {
        self.i += 1;
        let mut m = Map::new();
        loop {
            self.ws();
            if self.s.get(self.i) == Some(&b'}') {
                self.i += 1;
                return Ok(Value::Object(m));
            }
            let key = match self.value()? {
                Value::String(k) => k,
                other => other.to_string(),
            };
            self.ws();
            if self.s.get(self.i) != Some(&b':') {
                return Err(self.err("no ':' after a key"));
            }
            self.i += 1;
            self.ws();
            let v = self.value()?;
            m.insert(key, v);
            self.after_item(b'}')?;
        }
    }

    fn seq(&mut self, close: u8) -> Result<Value, String> {
        self.i += 1;
        let mut items = Vec::new();
        loop {
            self.ws();
            if self.s.get(self.i) == Some(&close) {
                self.i += 1;
                return Ok(Value::Array(items));
            }
            items.push(self.value()?);
            self.after_item(close)?;
        }
    }

    /// After an item: a comma, or the closing bracket (left for the caller).
    fn after_item(&mut self, close: u8) -> Result<(), String> {
        self.ws();
        match self.s.get(self.i) {
            Some(b',') => {
                self.i += 1;
                Ok(())
            }
            Some(&b) if b == close => Ok(()),
            _ => Err(self.err(&format!("no ',' or '{}'", close as char))),
        }
    }

    fn string(&mut self) -> Result<String, String> {
        let quote = self.s[self.i];
        self.i += 1;
        let mut out = String::new();
        loop {
            let rest = &self.text[self.i..];
            let Some(c) = rest.chars().next() else { return Err(self.err("an unterminated string")) };
            self.i += c.len_utf8();
            match c {
                c if c as u32 == quote as u32 => return Ok(out),
                '\\' => {
                    let Some(e) = self.text[self.i..].chars().next() else {
                        return Err(self.err("an unterminated string"));
                    };
                    self.i += e.len_utf8();
                    match e {
                        'n' => out.push('\n'),
                        't' => out.push('\t'),
                        'r' => out.push('\r'),
                        '0' => out.push('\0'),
                        'x' => out.push(self.hex(2)?),
                        'u' => out.push(self.hex(4)?),
                        'U' => out.push(self.hex(8)?),
                        other => out.push(other),
                    }
                }
                c => out.push(c),
            }
        }
    }

    fn hex(&mut self, n: usize) -> Result<char, String> {
        let digits = self.text.get(self.i..self.i + n).ok_or_else(|| self.err("a short escape"))?;
        let c =
            u32::from_str_radix(digits, 16).ok().and_then(char::from_u32).ok_or_else(|| self.err("a bad escape"))?;
        self.i += n;
        Ok(c)
    }

    /// A bare word up to the next `,`, `:` or closing bracket outside brackets and quotes.
    fn word(&mut self) -> Value {
        let start = self.i;
        let mut depth = 0usize;
        while let Some(&b) = self.s.get(self.i) {
            match b {
                b'\'' | b'"' => {
                    if self.string().is_err() {
                        break;
                    }
                    continue;
                }
                b'(' | b'[' | b'{' | b'<' => depth += 1,
                b')' | b']' | b'}' | b'>' if depth > 0 => depth -= 1,
                b')' | b']' | b'}' | b',' | b':' if depth == 0 => break,
                _ => {}
            }
            self.i += 1;
        }
        let w = self.text[start..self.i].trim();
        match w {
            "None" => Value::Null,
            "True" => Value::Bool(true),
            "False" => Value::Bool(false),
            _ => {
                if let Ok(n) = w.parse::<i64>() {
                    Value::Number(n.into())
                } else if let Some(n) = w.parse::<f64>().ok().and_then(Number::from_f64) {
                    Value::Number(n)
                } else {
                    Value::String(w.to_string())
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn vllm_non_default_args_as_logged() {
        // vLLM 0.32's line, recorded (tests/fixtures/engines/vllm/real/start-ngram.log).
        let line = "{'model_tag': '/srv/models/smollm2-135m-hf-0.1.2', 'host': '127.0.0.1', 'model': '/srv/models/smollm2-135m-hf-0.1.2', 'max_model_len': 2048, 'enforce_eager': True, 'speculative_config': {'method': 'ngram', 'num_speculative_tokens': 4, 'prompt_lookup_max': 3, 'prompt_lookup_min': 1}}";
        assert_eq!(
            parse(line).unwrap(),
            json!({
                "model_tag": "/srv/models/smollm2-135m-hf-0.1.2",
                "host": "127.0.0.1",
                "model": "/srv/models/smollm2-135m-hf-0.1.2",
                "max_model_len": 2048,
                "enforce_eager": true,
                "speculative_config": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
            })
        );
    }

    #[test]
    fn every_literal_kind() {
        let v = parse(
            r#"{"it's": 'a\'b\\c\x41\u00e9', 'f': 0.92, 'neg': -1, 'e': 1e-05, 'n': None, 'l': ['m', 2], 't': (1,), 'mode': <CompilationMode.NONE: 0>, 'p': PosixPath('/a,b'), 'x': False} trailing"#,
        )
        .unwrap();
        assert_eq!(
            v,
            json!({"it's": "a'b\\cAé", "f": 0.92, "neg": -1, "e": 1e-05, "n": null, "l": ["m", 2], "t": [1],
                   "mode": "<CompilationMode.NONE: 0>", "p": "PosixPath('/a,b')", "x": false})
        );
        assert_eq!(parse("{}").unwrap(), json!({}));
    }

    #[test]
    fn broken_literals_are_errors() {
        for bad in ["", "{'a' 1}", "{'a': 1", "{'a': 'b", "['a' 'b']", "{'a': '\\x4'}"] {
            assert!(parse(bad).is_err(), "{bad:?} parsed");
        }
    }
}
